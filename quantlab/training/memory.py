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
import mmap
import os
import resource
import sys

import torch
from torch import nn

from quantlab.utils.pages import CHECKPOINT_SUFFIX, drop_pages, file_mappings

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


def release_checkpoint_pages(model: nn.Module, suffix: str = CHECKPOINT_SUFFIX) -> int:
    """Drop the pages of `model`'s memory-mapped checkpoint that none of its tensors use any more.

    transformers reads a safetensors checkpoint through one memory map per load. When the
    weights are quantized while loading, every float weight is read once and then dropped,
    but its pages stay resident for as long as the map lives, and the map lives as long as
    any tensor still points into it (SmolLM2's float embedding does): 420 MB of fp32 weights
    the quantized model no longer has, counted in its resident memory. This returns them,
    with `madvise(MADV_DONTNEED)` on the page ranges of each map that hold none of the
    model's tensors; pages shared with a live tensor are kept, so nothing the model uses is
    touched. Linux only; returns the bytes released (0 elsewhere).
    """
    if not sys.platform.startswith("linux"):
        return 0
    live = _tensor_ranges(model)
    released = 0
    for start, end in file_mappings(suffix):
        inside = [(a, b) for a, b in live if a < end and b > start]
        if not inside:
            continue  # another model's map: its tensors are not ours to judge
        for gap_start, gap_end in _gaps(start, end, inside):
            released += drop_pages(gap_start, gap_end)
    return released


def _tensor_ranges(model: nn.Module) -> list[tuple[int, int]]:
    ranges = []
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.nbytes() and tensor.device.type == "cpu":
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return sorted(ranges)


def _gaps(start: int, end: int, live: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Whole pages of [start, end) that no live range touches."""
    page = mmap.PAGESIZE
    gaps, cursor = [], start
    for live_start, live_end in live:
        gap_end = max(start, live_start) // page * page
        if gap_end > cursor:
            gaps.append((cursor, gap_end))
        cursor = max(cursor, -(-min(live_end, end) // page) * page)
    if end > cursor:
        gaps.append((cursor, end))
    return gaps
