"""The kernel table: which function computes a quantized Linear, by (storage format, device).

Every format runs on the reference kernel (dequantize, then matmul), registered for the
wildcard `("*", "*")`. A faster kernel registers for its exact key and is tested against the
reference. Lookup order: `(format, device)`, `(format, "*")`, `("*", device)`, `("*", "*")`.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING

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


# The reference registers the wildcard kernel; cpu registers the native kernels for ("<format>", "cpu").
from quantlab.kernels import cpu, reference  # noqa: E402,F401
