"""On/off switches read from environment variables, spelled one way everywhere."""

import os

OFF = ("0", "false", "no", "off")


def switched_on(name: str) -> bool:
    """False when `name` is set to 0, false, no or off (any case); on when unset or set to anything else."""
    return os.environ.get(name, "1").strip().lower() not in OFF
