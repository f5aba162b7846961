"""Float32 scratch buffers reused from call to call.

A training step decodes each layer's weight (and its gradient) into a tensor as large as the layer, used
once and dropped. Above glibc's mmap threshold (32 MiB at most) every such allocation is a fresh mapping
whose pages fault in on first touch: on a 1.1B model's MLP layers (46 MB) that cost more than the layer's
arithmetic. A named buffer kept for the process and grown to the largest request serves them all instead;
its bytes are the largest layer's, once per name.
"""

import math
import threading

import torch

_local = threading.local()


def scratch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 tensor of `shape` (uninitialized) backed by the buffer `name` of this thread. The caller
    must be done with it before asking for `name` again: the next request returns the same memory."""
    buffers: dict[str, torch.Tensor] = getattr(_local, "buffers", None) or {}
    _local.buffers = buffers
    count = math.prod(shape)
    buffer = buffers.get(name)
    if buffer is None or buffer.numel() < count:
        buffer = torch.empty(count, dtype=torch.float32)
        buffers[name] = buffer
    return buffer[:count].view(shape)


def release_scratch() -> None:
    """Drop this thread's buffers (after training)."""
    _local.buffers = {}
