"""Giving back the pages of memory-mapped checkpoint files that no tensor needs any more.

transformers reads safetensors checkpoints through memory maps. Every page of the file a
weight was read from stays in the process's resident memory for as long as the map lives,
even after the weight was quantized and dropped. `madvise(MADV_DONTNEED)` on such pages
returns them; the mapping is read-only and file-backed, so a later read (of a tied weight,
say) faults the same bytes back in from the file: content is never lost. Only pages of
`.safetensors` file mappings are ever touched. Linux only; elsewhere nothing happens.
"""

import ctypes
import ctypes.util
import mmap
import sys
from functools import cache
from pathlib import Path

import torch

_MADV_DONTNEED = 4
CHECKPOINT_SUFFIX = ".safetensors"


def file_mappings(suffix: str = CHECKPOINT_SUFFIX) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of files whose name ends with `suffix`."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    mappings = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(suffix):
            start, end = (int(value, 16) for value in fields[0].split("-"))
            mappings.append((start, end))
    return mappings


def drop_pages(start: int, end: int) -> int:
    """`madvise(MADV_DONTNEED)` on [start, end), which must be page-aligned; the bytes dropped."""
    madvise = _madvise()
    if madvise is None or end <= start:
        return 0
    return end - start if madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) == 0 else 0


def release_mapped_tensor(tensor: torch.Tensor) -> int:
    """Drop the whole pages of a checkpoint-mapped `tensor` (the caller is done reading it).

    Pages the tensor shares with its neighbours in the file are kept. A tensor that does not
    live in a `.safetensors` map (on the heap, on a GPU) is left alone. Returns the bytes released.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or not sys.platform.startswith("linux"):
        return 0
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    if not any(start <= first and last <= end for start, end in file_mappings()):
        return 0
    page = mmap.PAGESIZE
    return drop_pages(-(-first // page) * page, last // page * page)


@cache
def _madvise():
    library = ctypes.util.find_library("c")
    return ctypes.CDLL(library).madvise if library and sys.platform.startswith("linux") else None
