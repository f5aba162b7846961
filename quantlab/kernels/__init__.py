"""The kernel tables: which function computes a quantized Linear, and which computes a quantize step.

Matmul kernels are keyed by (storage format, device); a layer's format is the codec of its
storage layout (`quantlab.formats.layout`), so a plugin layer that declares a built-in codec
runs on that codec's kernels. Every format runs on the reference kernel (dequantize, then
matmul), registered for the wildcard `("*", "*")`. A faster kernel registers for its exact key
and is tested against the reference. Lookup order: `(format, device)`, `(format, "*")`,
`("*", device)`, `("*", "*")`.

Quantize ops (`affine_quantize`, `nf4_quantize`, `pack`, ...) are keyed by (name, device). Each
computes exactly what the pure-torch definition in `quantlab.formats` computes, or returns None
when it cannot (library unavailable, unsupported input); `quantlab.kernels.quantize` asks this
table and falls back to the definition.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from quantlab.nn import QuantizedLinear

Kernel = Callable[["QuantizedLinear", torch.Tensor], torch.Tensor]
ANY = "*"
_KERNELS: dict[tuple[str, str], Kernel] = {}
_SELECTED: dict[tuple[str, str], Kernel] = {}  # lookups already made; every forward pass makes one


def register_kernel(format: str, device_type: str = ANY) -> Callable[[Kernel], Kernel]:
    """Decorator: make `kernel` the one used for layers of `format` on `device_type`."""

    def decorator(kernel: Kernel) -> Kernel:
        _KERNELS[(format, device_type)] = kernel
        _SELECTED.clear()
        return kernel

    return decorator


def select_kernel(format: str, device_type: str) -> Kernel:
    kernel = _SELECTED.get((format, device_type))
    if kernel is not None:
        return kernel
    for key in ((format, device_type), (format, ANY), (ANY, device_type), (ANY, ANY)):
        kernel = _KERNELS.get(key)
        if kernel is not None:
            _SELECTED[(format, device_type)] = kernel
            return kernel
    raise LookupError(f"no kernel for format {format!r} on {device_type!r}")


def registered_kernels() -> dict[tuple[str, str], Kernel]:
    return dict(_KERNELS)


QuantizeOp = Callable[..., Any]
_QUANTIZE_OPS: dict[tuple[str, str], QuantizeOp] = {}


def register_quantize_op(name: str, device_type: str) -> Callable[[QuantizeOp], QuantizeOp]:
    """Decorator: make `op` the fast path of the quantize step `name` for tensors on `device_type`."""

    def decorator(op: QuantizeOp) -> QuantizeOp:
        _QUANTIZE_OPS[(name, device_type)] = op
        return op

    return decorator


def quantize_op(name: str, device_type: str) -> QuantizeOp | None:
    """The registered fast path of `name` on `device_type`, or None (then use `quantlab.formats`)."""
    return _QUANTIZE_OPS.get((name, device_type))


# The reference registers the wildcard kernel; cpu registers the native kernels for ("<codec>", "cpu")
# and the native quantize ops for ("<op>", "cpu").
from quantlab.kernels import cpu, reference  # noqa: E402,F401
