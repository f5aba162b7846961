"""Keeping a long computation's resident memory at what its live tensors need (glibc on Linux).

glibc serves allocations below its mmap threshold (128 KiB, raised up to 32 MiB as large blocks
are freed) from its heaps, and a freed chunk stays part of the process's resident memory until
the heap's top is free. Quantizing block after block frees and allocates many tensors of a few
MiB in slightly different orders, so the holes left behind add up and the resident size creeps.

- `return_freed_memory` (`malloc_trim(0)`) returns every free page of every heap: cheap, and called
  between phases it keeps the peak at what the live tensors need. It cannot return pages a few
  live chunks still pin, so a calibrated run over many blocks still creeps (about one copy of the
  calibration activations per block).
- `map_large_allocations` gives every tensor above 64 KiB its own mapping, returned whole when
  freed, and the peak stays flat. But a solver's temporaries, allocated and freed many times a
  layer, then fault their pages in afresh at every allocation (GPTQ about 1.8x slower), so
  `heap_for_temporaries` lets them come from the heap again while a solver runs.
Elsewhere these are no-ops.
"""

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
LARGE_ALLOCATION_BYTES = 64 * 1024
TEMPORARY_ALLOCATION_BYTES = 32 * 1024 * 1024  # the highest threshold glibc's own adjustment reaches
_mapping_large = False  # whether map_large_allocations made the setting (so the heap may be lent back)


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
    global _mapping_large
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    _mapping_large = _set_threshold(threshold)
    return _mapping_large


@contextlib.contextmanager
def heap_for_temporaries() -> Iterator[None]:
    """Within: allocations up to 32 MiB come from the heap (glibc's threshold once it has adapted), so
    the many short-lived temporaries of a solver reuse warm pages; on leaving, the heap's free pages are
    returned and large allocations are mapped again. Does nothing unless `map_large_allocations` set
    the threshold. Tensors that outlive the block (the calibration activations) must not be made here."""
    if not _mapping_large:
        yield
        return
    _set_threshold(TEMPORARY_ALLOCATION_BYTES)
    try:
        yield
    finally:
        return_freed_memory()
        _set_threshold(LARGE_ALLOCATION_BYTES)


def _set_threshold(threshold: int) -> bool:
    mallopt = _libc_function("mallopt")
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, threshold) == 1


@functools.cache
def _libc_function(name: str) -> Any:
    library = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    return getattr(ctypes.CDLL(library), name, None) if library else None
