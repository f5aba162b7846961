"""Fast paths of the rounding steps: an op registered for the tensor's device, else the definition.

Quantize ops (`affine_quantize`, `nf4_quantize`, `pack`, ...) are keyed by (name, device). Each
computes exactly what the pure-torch definition in `quantlab.formats` computes, or returns None
when it cannot (library unavailable, unsupported input), and the caller then runs the
definition. So a result never depends on whether a native library could be built, only the
time does (the native CPU ops are in `quantlab.kernels.cpu.quantize`; their speed against torch
is in benchmarks/RESULTS.md). The codecs call `run`; callers outside `quantlab.formats` use the
wrappers below.
"""

from collections.abc import Callable
from typing import Any

import torch

from quantlab.formats import packing

QuantizeOp = Callable[..., Any]
_QUANTIZE_OPS: dict[tuple[str, str], QuantizeOp] = {}
INT8_OFFSET = 128


def register_quantize_op(name: str, device_type: str) -> Callable[[QuantizeOp], QuantizeOp]:
    """Decorator: make `op` the fast path of the quantize step `name` for tensors on `device_type`."""

    def decorator(op: QuantizeOp) -> QuantizeOp:
        _QUANTIZE_OPS[(name, device_type)] = op
        return op

    return decorator


def quantize_op(name: str, device_type: str) -> QuantizeOp | None:
    """The registered fast path of `name` on `device_type`, or None (then use the definition)."""
    return _QUANTIZE_OPS.get((name, device_type))


def run(name: str, tensor: torch.Tensor, *args: Any) -> Any:
    """The result of the op `name` registered for `tensor`'s device, or None (none, or it declined)."""
    op = _QUANTIZE_OPS.get((name, tensor.device.type))
    return None if op is None else op(*args)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`quantlab.formats.packing.pack`."""
    native = run("pack", codes, codes, bits)
    return native if native is not None else packing.pack(codes, bits)


def bucketize(values: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """Bucket index (int32) of each value among sorted `boundaries`; ties go to the lower bucket."""
    native = run("bucketize", values, values, boundaries)
    return native if native is not None else torch.bucketize(values, boundaries, out_int32=True)


def offset_to_signed(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes `q + 128` as int8 `q`; `codes` itself is left as it is."""
    codes = codes.to(torch.uint8, copy=True, memory_format=torch.contiguous_format)
    native = run("offset_to_signed", codes, codes)  # converts its own copy in place
    return native if native is not None else (codes.to(torch.int16) - INT8_OFFSET).to(torch.int8)
