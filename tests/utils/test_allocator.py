"""The C allocator settings quantlab makes between and before long phases (glibc on Linux)."""

import os
import subprocess
import sys

import pytest

_SET = "from quantlab.utils.allocator import map_large_allocations; print(map_large_allocations())"


def _run(environment: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", _SET], env=environment, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_allocations_get_their_own_maps_unless_the_user_chose_a_threshold():
    environment = {key: value for key, value in os.environ.items() if key != "MALLOC_MMAP_THRESHOLD_"}
    assert _run(environment) == "True"
    assert _run({**environment, "MALLOC_MMAP_THRESHOLD_": "131072"}) == "False"
