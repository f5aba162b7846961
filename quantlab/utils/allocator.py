"""Keeping a long computation's resident memory at what its live tensors need (glibc on Linux).

glibc serves allocations below its mmap threshold (128 KiB, raised up to 32 MiB as large blocks
are freed) from its heaps, and a freed chunk stays part of the process's resident memory until
the heap's top is free. Quantizing block after block frees and allocates many tensors of a few
MiB in slightly different orders, so the holes left behind add up and the resident size creeps.

- `return_freed_memory` (`malloc_trim(0)`) returns every free page of every heap: cheap, and called
  between phases it keeps the peak at what the live tensors need. It cannot return pages a few
  live chunks still pin.
- `copy_to_own_mapping` moves a tensor that outlives the phase that made it (the calibration
  activations carried from block to block) into an anonymous memory map of its own, returned
  whole when the tensor dies, so the long-lived data never pins heap pages. Lowering the mmap
  threshold for the whole process does the same for every tensor, but then each temporary of the
  solvers is a fresh mapping whose pages fault in and are zeroed again at every use: GPTQ ran
  about 1.8x slower that way (benchmarks/RESULTS.md).
"""

import ctypes
import ctypes.util
import functools
import mmap
import sys
from typing import Any

import torch

OWN_MAPPING_BYTES = 1 << 20  # smaller tensors stay where they are: a mapping per small tensor costs more than it saves


def return_freed_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc only)."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def copy_to_own_mapping(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor of at least `OWN_MAPPING_BYTES` in an anonymous memory map of its
    own (unmapped when the copy and every view of it are gone); other tensors are returned as they are."""
    if tensor.device.type != "cpu" or tensor.nbytes < OWN_MAPPING_BYTES or tensor.requires_grad:
        return tensor
    mapping = mmap.mmap(-1, tensor.nbytes)
    copy = torch.frombuffer(mapping, dtype=tensor.dtype, count=tensor.numel()).view(tensor.shape)
    return copy.copy_(tensor)


@functools.cache
def _libc_function(name: str) -> Any:
    library = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    return getattr(ctypes.CDLL(library), name, None) if library else None
