"""The ctypes kernels as Python torch operators, for quantized layers inside torch.compile.

Without the C++ extension (`ops.py`), eager calls reach the C library through ctypes with a
description cached per layer (`weights.native_weight`). Dynamo must not trace that: it resolves
the cache's weak-dictionary lookup to "the entry at position i", guarded by the key's type only,
so a compiled frame hands one layer another layer's description (wrong shapes, or silently wrong
outputs). Under torch.compile the layers call these operators instead: opaque to dynamo (no graph
break, the step stays one graph), their arguments the layout's descriptor and the stored tensors as
`ops.weight_arguments` gives them, described afresh on every call (`weights.describe_arguments`).
Gradients flow to the input, `grad @ W` with W decoded by the C library.
"""

import torch

from quantlab.formats.layout import parse_descriptor
from quantlab.kernels.cpu import native, ops
from quantlab.kernels.cpu.weights import describe_arguments
from quantlab.utils.compile_constants import constant_result


@constant_result
def available() -> bool:
    """True when the C library is loaded: a constant to torch.compile (dynamo would trace the loading)."""
    return native.library() is not None


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` (no bias) of a layer with a built-in codec, as one operator call."""
    return torch.ops.quantlab_ctypes.linear(x, *ops.weight_arguments(module))


# The weight's arguments, as `ops.weight_arguments` gives them (the C++ operators' WEIGHT_ARGS).
WEIGHT_SCHEMA = (
    "str layout, Tensor codes, Tensor? scale=None, Tensor? zero=None, Tensor? absmax_codes=None, "
    "Tensor? absmax_scale=None, Tensor? absmax_offset=None"
)
torch.library.define("quantlab_ctypes::linear", f"(Tensor x, {WEIGHT_SCHEMA}) -> Tensor")
torch.library.define("quantlab_ctypes::dequantize", f"({WEIGHT_SCHEMA}) -> Tensor")


@torch.library.impl("quantlab_ctypes::linear", "CPU")
def _linear(x: torch.Tensor, *weight) -> torch.Tensor:
    from quantlab.kernels.cpu.linear import _forward

    return _forward(describe_arguments(*weight), x)


@torch.library.register_fake("quantlab_ctypes::linear")
def _linear_shape(x: torch.Tensor, descriptor: str, codes: torch.Tensor, *weight) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


@torch.library.impl("quantlab_ctypes::dequantize", "CPU")
def _dequantize(*weight) -> torch.Tensor:
    from quantlab.kernels.cpu.linear import native_dequantize

    return native_dequantize(describe_arguments(*weight))


@torch.library.register_fake("quantlab_ctypes::dequantize")
def _dequantize_shape(descriptor: str, codes: torch.Tensor, *weight) -> torch.Tensor:
    in_features = parse_descriptor(descriptor).in_features
    return codes.new_empty((codes.shape[0], in_features), dtype=torch.float32)


def _save_weight(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.weight = inputs[1:]


def _grad_input(ctx, grad: torch.Tensor):
    decoded = torch.ops.quantlab_ctypes.dequantize(*ctx.weight)
    out_features, in_features = decoded.shape
    grad_x = (grad.reshape(-1, out_features).float() @ decoded).view(*grad.shape[:-1], in_features)
    return grad_x.to(grad.dtype), *(None for _ in ctx.weight)


torch.library.register_autograd("quantlab_ctypes::linear", _grad_input, setup_context=_save_weight)
