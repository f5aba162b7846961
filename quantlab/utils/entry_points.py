"""Loading the plugins of an entry-point group: a broken plugin warns, it never takes quantlab down."""

import warnings
from importlib.metadata import entry_points


def load_entry_points(group: str, kind: str) -> None:
    """Import every entry point of `group` and call it when it is callable (it registers itself)."""
    for entry_point in entry_points(group=group):
        try:
            loaded = entry_point.load()
            if callable(loaded):
                loaded()
        except Exception as error:  # a plugin's failure must not take quantlab down
            warnings.warn(
                f"quantlab {kind} {entry_point.name!r} ({entry_point.value}) failed to load and is skipped: {error}",
                RuntimeWarning,
                stacklevel=3,
            )
