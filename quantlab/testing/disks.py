"""A small real filesystem for full-disk tests: a tmpfs of a chosen size."""

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(mountpoint: Path, kilobytes: int) -> Iterator[Path]:
    """Mount a tmpfs of `kilobytes` at `mountpoint` (created) for the block; skips the test where
    mounting is not allowed (it needs root)."""
    mountpoint.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={kilobytes}k", "tmpfs", str(mountpoint)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)
