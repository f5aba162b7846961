"""Memory figures for the training log, and giving freed memory back.

On CPU the figure is the process's resident memory: the peak (`ru_maxrss`, the high-water
mark since the process started) and the current value. Resident memory includes what the
allocator keeps after tensors are freed, so compare runs under the same allocator settings
(`MALLOC_MMAP_THRESHOLD_`, see `benchmarks/training.py`). On CUDA the figures are the
caching allocator's peak and current allocation.
"""

import contextlib
import ctypes
import ctypes.util
import os
import resource
import sys

import torch

MIB = 1 << 20


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak memory of the process so far: device memory on CUDA, resident memory otherwise."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def current_memory_bytes(device: torch.device | None = None) -> int:
    if device is not None and device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no procfs: the peak is the best figure there is
        return peak_memory_bytes(device)


def release_cached_memory() -> None:
    """Empty the accelerator's cache and, on glibc, return freed heap pages to the system."""
    from accelerate.utils.memory import clear_device_cache

    clear_device_cache(garbage_collection=False)
    _malloc_trim()


def _malloc_trim() -> None:
    library = ctypes.util.find_library("c")
    if not library or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL(library).malloc_trim(0)
