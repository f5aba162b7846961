"""Giving the memory the C allocator keeps free back to the system, between phases of a long computation.

glibc serves allocations below its mmap threshold (128 KiB, raised up to 32 MiB as large blocks
are freed) from its heaps, and a freed chunk stays part of the process's resident memory until
the heap's top is free. Quantizing block after block frees and allocates many tensors of a few
MiB in slightly different orders, so the holes left behind add up and the resident size creeps.
`malloc_trim(0)` returns every free page of every heap (`madvise(MADV_DONTNEED)`): cheap, and
called between phases it keeps the peak at what the live tensors need. Elsewhere a no-op.
"""

import ctypes
import ctypes.util
import functools
import sys
from typing import Any


def return_freed_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc only)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    library = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    return getattr(ctypes.CDLL(library), "malloc_trim", None) if library else None
