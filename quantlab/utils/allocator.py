"""Giving the memory the C allocator keeps free back to the system, between phases of a long computation.

glibc serves allocations below its mmap threshold (128 KiB, raised up to 32 MiB as large blocks
are freed) from its heaps, and a freed chunk stays part of the process's resident memory until
the heap's top is free. Quantizing block after block frees and allocates many tensors of a few
MiB in slightly different orders, so the holes left behind add up and the resident size creeps.
`malloc_trim(0)` returns every free page of every heap (`madvise(MADV_DONTNEED)`): cheap, and
called between phases it keeps the peak at what the live tensors need. It cannot return pages a
few live chunks still pin, so a calibrated run over many blocks still creeps (about one copy of
the calibration activations per block); `map_large_allocations` gives every tensor above a small
threshold its own mapping, returned whole when freed, and the peak stays flat. Elsewhere no-ops.
"""

import ctypes
import ctypes.util
import functools
import os
import sys
from typing import Any

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
LARGE_ALLOCATION_BYTES = 64 * 1024


def return_freed_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc only)."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def map_large_allocations(threshold: int = LARGE_ALLOCATION_BYTES) -> bool:
    """Serve every allocation of `threshold` bytes or more from its own memory map (glibc only), so a
    freed tensor's pages go back to the system at once; returns whether the setting was made.

    Process-wide and permanent (it also stops glibc's own threshold from rising). A threshold the
    user set (`MALLOC_MMAP_THRESHOLD_`) is kept."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = _libc_function("mallopt")
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, threshold) == 1


@functools.cache
def _libc_function(name: str) -> Any:
    library = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    return getattr(ctypes.CDLL(library), name, None) if library else None
