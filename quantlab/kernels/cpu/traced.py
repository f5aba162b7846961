"""The ctypes kernels as Python torch operators, for quantized layers inside torch.compile.

Without the C++ extension (`ops.py`), eager calls reach the C library through ctypes with a
description cached per layer (`weights.native_weight`). Dynamo must not trace that: it resolves
the cache's weak-dictionary lookup to "the entry at position i", guarded by the key's type only,
so a compiled frame hands one layer another layer's description (wrong shapes, or silently wrong
outputs). Under torch.compile the layers call these operators instead: opaque to dynamo (no graph
break, the step stays one graph), their arguments the layer's stored tensors and layout integers as
`ops.weight_arguments` gives them, described afresh on every call (`weights.describe_arguments`).
Gradients flow to the input, `grad @ W` with W decoded by the C library.
"""

import torch

from quantlab.kernels.cpu import native, ops
from quantlab.kernels.cpu.weights import describe_arguments

OptionalTensor = torch.Tensor | None


@torch.compiler.assume_constant_result
def available() -> bool:
    """True when the C library is loaded: a constant to torch.compile (dynamo would trace the loading)."""
    return native.library() is not None


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` (no bias) of a layer with a built-in codec, as one operator call."""
    return torch.ops.quantlab_ctypes.linear(x, *ops.weight_arguments(module))


@torch.library.custom_op("quantlab_ctypes::linear", mutates_args=())
def _linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: OptionalTensor,
    zero: OptionalTensor,
    absmax_codes: OptionalTensor,
    absmax_scale: OptionalTensor,
    absmax_offset: OptionalTensor,
    kind: int,
    bits: int,
    in_features: int,
    group_size: int,
    absmax_block: int,
    zero_const: float,
) -> torch.Tensor:
    from quantlab.kernels.cpu.linear import _forward

    weight = describe_arguments(codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, kind, bits,
                                in_features, group_size, absmax_block, zero_const)  # fmt: skip
    return _forward(weight, x)


@_linear.register_fake
def _linear_shape(x: torch.Tensor, codes: torch.Tensor, *weight) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


@torch.library.custom_op("quantlab_ctypes::dequantize", mutates_args=())
def _dequantize(
    codes: torch.Tensor,
    scale: OptionalTensor,
    zero: OptionalTensor,
    absmax_codes: OptionalTensor,
    absmax_scale: OptionalTensor,
    absmax_offset: OptionalTensor,
    kind: int,
    bits: int,
    in_features: int,
    group_size: int,
    absmax_block: int,
    zero_const: float,
) -> torch.Tensor:
    from quantlab.kernels.cpu.linear import native_dequantize

    weight = describe_arguments(codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, kind, bits,
                                in_features, group_size, absmax_block, zero_const)  # fmt: skip
    return native_dequantize(weight)


@_dequantize.register_fake
def _dequantize_shape(codes: torch.Tensor, *weight) -> torch.Tensor:
    in_features = weight[7]
    return codes.new_empty((codes.shape[0], in_features), dtype=torch.float32)


def _save_weight(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.weight = inputs[1:]


def _grad_input(ctx, grad: torch.Tensor):
    decoded = torch.ops.quantlab_ctypes.dequantize(*ctx.weight)
    out_features, in_features = decoded.shape
    grad_x = (grad.reshape(-1, out_features).float() @ decoded).view(*grad.shape[:-1], in_features)
    return grad_x.to(grad.dtype), *(None for _ in ctx.weight)


_linear.register_autograd(_grad_input, setup_context=_save_weight)
