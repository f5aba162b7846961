"""The kernel tables: which function computes a quantized Linear, and which computes a quantize step.

Matmul kernels are keyed by (storage format, device); a layer's format is the codec of its
storage layout (`quantlab.formats.layout`), so a plugin layer that declares a built-in codec
runs on that codec's kernels. Every format runs on the reference kernel (dequantize, then
matmul), registered for the wildcard `("*", "*")`. A faster kernel registers for its exact key
and is tested against the reference. Lookup order: `(format, device)`, `(format, "*")`,
`("*", device)`, `("*", "*")`.

Quantize ops (`affine_quantize`, `nf4_quantize`, `pack`, ...), the fast paths of the codecs'
round-to-nearest, are keyed by (name, device) in `quantlab.formats.fast_path`; each computes
exactly what the codec's definition computes, or returns None and the codec runs the definition.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from quantlab.formats.fast_path import quantize_op, register_quantize_op

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


__all__ = ["ANY", "Kernel", "quantize_op", "register_kernel", "register_quantize_op", "select_kernel"]

# The reference registers the wildcard kernel; cpu registers the native kernels for ("<codec>", "cpu")
# and the native quantize ops for ("<op>", "cpu").
from quantlab.kernels import cpu, reference  # noqa: E402,F401
