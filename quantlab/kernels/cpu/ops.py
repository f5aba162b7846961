"""The native kernels as torch operators: what torch needs beside the C++ (`csrc/torch_ops.cpp`).

`torch.ops.quantlab.linear(x, *linear_arguments(layer))` is `x @ W.T + bias` for a quantized layer, and
`torch.ops.quantlab.dequantize(*weight_arguments(layer))` its float32 `[out, in]` weight.
`torch.ops.quantlab.linear_group(x, biases, codes, scales, ...)` is several such layers of one layout
on one `x`, their outputs side by side in one call (`group_arguments`); the compiled decode step
fuses q/k/v and gate/up into it (quantlab.generation.fusion). Here
they get their fake (meta) implementations, so torch.compile and torch.export trace shapes
without running them. The autograd formula of `linear` with respect to `x` (QLoRA trains
adapters on top of frozen quantized layers), `grad @ W` decoding the weight again in the
backward pass, is registered in C++ for the Autograd key: a Python autograd registration
(`torch.library.register_autograd`) costs about 6 us on every call, even without gradients.

The weight arguments are the layer's stored tensors as they are (codes, scales, zero points,
NF4's double-quantized absmax) and its layout's integers; the operator describes them to the C
kernels on every call, so it is a pure function of its inputs.
"""

from collections.abc import Callable

import torch

from quantlab.formats import nf4
from quantlab.formats.layout import StorageLayout
from quantlab.kernels.cpu import extension, native
from quantlab.kernels.cpu.weights import AFFINE, INT8, NF4

WeightArguments = tuple
_ARGUMENTS: dict[str, Callable[[torch.nn.Module, StorageLayout], WeightArguments]] = {}


def _arguments_of(codec: str):
    def decorator(function):
        _ARGUMENTS[codec] = function
        return function

    return decorator


def linear_arguments(module: torch.nn.Module) -> tuple:
    """The arguments of `torch.ops.quantlab.linear` after `x`: (bias, *weight_arguments(module))."""
    bias = module._parameters.get("bias")
    return (bias if bias is not None else getattr(module, "bias", None), *weight_arguments(module))


def weight_arguments(module: torch.nn.Module) -> WeightArguments:
    """(codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, kind, bits, in_features,
    group_size, absmax_block, zero_const) of a layer with a built-in codec."""
    layout = module.layout
    return _ARGUMENTS[layout.codec](module, layout)


def _stored(module: torch.nn.Module, name: str) -> torch.Tensor:
    """A stored tensor (a buffer: read from `_buffers`, four times faster than `getattr` per call)."""
    tensor = module._buffers.get(name)
    return tensor if tensor is not None else getattr(module, name)


@_arguments_of("affine")
def _affine(module: torch.nn.Module, layout: StorageLayout) -> WeightArguments:
    zero = _stored(module, "weight_zero") if layout.has_zero else None
    shape = (AFFINE, layout.bits, module.in_features, layout.group_length, 0, float(layout.constant_zero))
    return (_stored(module, "weight"), _stored(module, "weight_scale"), zero, None, None, None, *shape)


@_arguments_of("int8")
def _int8(module: torch.nn.Module, layout: StorageLayout) -> WeightArguments:
    shape = (INT8, layout.bits, module.in_features, layout.group_length, 0, 0.0)
    return (_stored(module, "weight"), _stored(module, "weight_scale"), None, None, None, None, *shape)


@_arguments_of("nf4")
def _nf4(module: torch.nn.Module, layout: StorageLayout) -> WeightArguments:
    codes = _stored(module, "weight")
    if layout.double_quant:
        shape = (NF4, layout.bits, module.in_features, layout.group_length, nf4.ABSMAX_BLOCKSIZE, 0.0)
        names = ("weight_absmax_codes", "weight_absmax_scale", "weight_absmax_offset")
        return (codes, None, None, *(_stored(module, name) for name in names), *shape)
    shape = (NF4, layout.bits, module.in_features, layout.group_length, 0, 0.0)
    return (codes, _stored(module, "weight_absmax"), None, None, None, None, *shape)


def group_arguments(modules: list[torch.nn.Module]) -> tuple:
    """The arguments of `torch.ops.quantlab.linear_group` after `x`, for layers of one layout: the
    biases, then each tensor argument of `weight_arguments` as a list, then the shared integers."""
    per_module = [linear_arguments(module) for module in modules]
    tensors = [list(column) for column in zip(*(arguments[:7] for arguments in per_module), strict=True)]
    return (*tensors, *per_module[0][7:])


@torch.compiler.assume_constant_result
def available() -> bool:
    """True when `linear_op` runs the native kernels here (building the extension on first use).

    A constant to torch.compile (checked once while tracing), so a compiled graph holds the
    operator without a guard or a break. Eager calls check `QUANTLAB_NATIVE_KERNELS` each time
    (`native.library()`), as the ctypes path does.
    """
    if linear_op is not None:
        return native.library() is not None
    if native.library() is None or extension.load() is None:
        return False
    _register()
    return True


linear_op: torch._ops.OpOverload | None = None  # torch.ops.quantlab.linear.default, once loaded
dequantize_op: torch._ops.OpOverload | None = None
linear_group_op: torch._ops.OpOverload | None = None


def _register() -> None:
    """The operators' fake implementations (shapes only), and their overloads looked up once: calling the
    overload costs about 1.5 us less per call than the `torch.ops.quantlab.linear` packet."""
    global linear_op, dequantize_op, linear_group_op
    torch.library.register_fake("quantlab::linear")(_linear_shape)
    torch.library.register_fake("quantlab::linear_group")(_linear_group_shape)
    torch.library.register_fake("quantlab::dequantize")(_dequantize_shape)
    dequantize_op = torch.ops.quantlab.dequantize.default
    linear_group_op = torch.ops.quantlab.linear_group.default
    linear_op = torch.ops.quantlab.linear.default


def _linear_shape(x: torch.Tensor, bias: torch.Tensor | None, codes: torch.Tensor, *weight) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def _linear_group_shape(x: torch.Tensor, biases: list, codes: list[torch.Tensor], *weights) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(c.shape[0] for c in codes)))


def _dequantize_shape(codes: torch.Tensor, *weight) -> torch.Tensor:
    in_features = weight[7]
    return codes.new_empty((codes.shape[0], in_features), dtype=torch.float32)
