"""Stored weights moved into one mapping the kernel is asked to back with 2 MiB pages.

A decoded token reads every quantized weight once, from DRAM: with 4 KiB pages each 4 KiB of codes
costs a TLB miss and a page walk (two levels of tables in a virtual machine), and the hardware
prefetchers stop at every page boundary. Linux backs an anonymous mapping advised `MADV_HUGEPAGE` with
2 MiB pages when transparent huge pages are `always` or `madvise` (most distributions' default); one
TLB entry then covers 512 times as much (the decode step's time with and without: benchmarks/RESULTS.md).
The system's settings are read, never changed: where huge pages are off the advice is ignored and the
weights simply move.

Each moved tensor keeps its values, dtype and shape and gets a storage of its own inside the mapping,
so state dicts and safetensors see separate tensors; the mapping is freed when the last of them is
(moving them again copies them into a new one). `QUANTLAB_HUGE_PAGES=0` leaves every tensor where it is.
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Iterable

import torch

from quantlab.utils.environment import switched_on

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # each tensor starts on a cache line


def available() -> bool:
    """True where the advice exists (Linux) and is wanted; whether the kernel follows it is its own setting."""
    return switched_on("QUANTLAB_HUGE_PAGES") and sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def _movable(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`module`'s stored tensors held as buffers or parameters, on the CPU."""
    tensors = module.stored_tensors() if hasattr(module, "stored_tensors") else {}
    found = []
    for name, tensor in tensors.items():
        held = name in module._buffers or name in module._parameters
        if held and tensor.device.type == "cpu" and tensor.numel():
            found.append((name, tensor))
    return found


def move_to_huge_pages(modules: Iterable[torch.nn.Module]) -> int:
    """Move the stored tensors of `modules` (quantized layers and tables) into one huge-page mapping.

    Buffers are replaced by the moved tensors; parameters keep their object and take the moved data.
    Returns the bytes moved (0 when there was nothing to move, or off Linux).
    """
    if not available():
        return 0
    plan: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    offsets: dict[int, int] = {}  # id of each tensor to move -> its place: a tensor two modules hold moves once
    size = 0
    for module in dict.fromkeys(modules):  # each module once, in order
        for name, tensor in _movable(module):
            plan.append((module, name, tensor))
            if id(tensor) not in offsets:
                offsets[id(tensor)] = size
                size += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    if not plan:
        return 0
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: no huge pages
    start = (-_address(mapping)) % HUGE_PAGE  # the first tensor on a 2 MiB boundary
    mapping.madvise(mmap.MADV_HUGEPAGE)
    moved_tensors: dict[int, torch.Tensor] = {}
    for module, name, tensor in plan:
        moved = moved_tensors.get(id(tensor))
        if moved is None:
            moved = torch.frombuffer(
                mapping, dtype=tensor.dtype, count=tensor.numel(), offset=start + offsets[id(tensor)]
            )
            moved = moved.view(tensor.shape)
            moved.copy_(tensor.detach())
            moved_tensors[id(tensor)] = moved
        if name in module._parameters:
            module._parameters[name].data = moved
        else:
            module._buffers[name] = moved
    return size


def _address(mapping: mmap.mmap) -> int:
    return torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
