"""The native kernels as torch operators: what torch needs beside the C++ (`csrc/torch_ops.cpp`).

`torch.ops.quantlab.linear(x, *linear_arguments(layer))` is `x @ W.T + bias` for a quantized layer, and
`torch.ops.quantlab.dequantize(*weight_arguments(layer))` its float32 `[out, in]` weight.
`torch.ops.quantlab.linear_group(x, biases, descriptor, codes, scales, ...)` is several such layers of one layout
on one `x`, their outputs side by side in one call (`group_arguments`); the compiled decode step
fuses q/k/v and gate/up into it (quantlab.generation.fusion).
`torch.ops.quantlab.attention(query, key, value, mask, scale)` is the attention of one-token queries over
a KV cache, grouped-query heads read in place (the compiled decode step's: quantlab.generation.attention);
it has no autograd formula, so it is called only where no gradient is asked for (the caller checks). Here
they get their fake (meta) implementations, so torch.compile and torch.export trace shapes
without running them. The autograd formula of `linear` with respect to `x` (QLoRA trains
adapters on top of frozen quantized layers), `grad @ W` decoding the weight again in the
backward pass, is registered in C++ for the Autograd key: a Python autograd registration
(`torch.library.register_autograd`) costs time on every call, even without gradients (see benchmarks/RESULTS.md).

The weight arguments are the layout's `descriptor` (a string of the integers that decode it: one
argument, where an eager call converts each number on its own) and the layer's stored tensors as
they are (codes, scales, zero points, NF4's double-quantized absmax), absent trailing ones left out;
the operator describes them to the C kernels on every call, so it is a pure function of its inputs.
"""

import torch

from quantlab.formats.layout import parse_descriptor
from quantlab.kernels.cpu import extension, native
from quantlab.utils.compile_constants import constant_result

WeightArguments = tuple


def linear_arguments(module: torch.nn.Module) -> tuple:
    """The arguments of `torch.ops.quantlab.linear` after `x`: (bias, *weight_arguments(module))."""
    bias = module._parameters.get("bias")
    return (bias if bias is not None else getattr(module, "bias", None), *weight_arguments(module))


def weight_arguments(module: torch.nn.Module) -> WeightArguments:
    """(descriptor, codes, *other stored tensors) of a layer whose codec the native kernels decode, in the
    operators' order (scale, zero, absmax_codes, absmax_scale, absmax_offset), the trailing absent ones left
    out: the codec names them (`StorageLayout.native_arguments`)."""
    layout = module.layout
    buffers = module._buffers
    return (
        layout.descriptor,
        _stored(module, buffers, "weight"),
        *[None if name is None else _stored(module, buffers, name) for name in layout.native_arguments],
    )


def _stored(module: torch.nn.Module, buffers: dict, name: str) -> torch.Tensor:
    """A stored tensor (a buffer: read from `_buffers`, faster than `getattr` on every call)."""
    tensor = buffers.get(name)
    return tensor if tensor is not None else getattr(module, name)


WEIGHT_TENSORS = 6  # codes, scale, zero, absmax_codes, absmax_scale, absmax_offset


def group_arguments(modules: list[torch.nn.Module]) -> tuple:
    """The arguments of `torch.ops.quantlab.linear_group` after `x`, for layers of one layout: the
    biases, the shared descriptor, then each stored-tensor argument of `weight_arguments` as a list."""
    per_module = [linear_arguments(module) for module in modules]
    descriptors = {arguments[1] for arguments in per_module}
    if len(descriptors) != 1:
        raise ValueError(f"linear_group takes layers of one layout, got {sorted(descriptors)}")
    tensors = [(*arguments[2:], *[None] * (WEIGHT_TENSORS + 2 - len(arguments))) for arguments in per_module]
    biases = [arguments[0] for arguments in per_module]
    return (biases, descriptors.pop(), *(list(column) for column in zip(*tensors, strict=True)))


@constant_result
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
attention_op: torch._ops.OpOverload | None = None


def _register() -> None:
    """The operators' fake implementations (shapes only), and their overloads looked up once: calling the
    overload skips the `torch.ops.quantlab.linear` packet's overload resolution on every call."""
    global linear_op, dequantize_op, linear_group_op, attention_op
    torch.library.register_fake("quantlab::linear")(_linear_shape)
    torch.library.register_fake("quantlab::linear_group")(_linear_group_shape)
    torch.library.register_fake("quantlab::dequantize")(_dequantize_shape)
    torch.library.register_fake("quantlab::attention")(_attention_shape)
    dequantize_op = torch.ops.quantlab.dequantize.default
    linear_group_op = torch.ops.quantlab.linear_group.default
    attention_op = torch.ops.quantlab.attention.default
    linear_op = torch.ops.quantlab.linear.default


def _linear_shape(x: torch.Tensor, bias: torch.Tensor | None, descriptor: str, codes: torch.Tensor, *weight):
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def _linear_group_shape(x: torch.Tensor, biases: list, descriptor: str, codes: list[torch.Tensor], *weights):
    return x.new_empty((*x.shape[:-1], sum(c.shape[0] for c in codes)))


def _dequantize_shape(descriptor: str, codes: torch.Tensor, *weight) -> torch.Tensor:
    in_features = parse_descriptor(descriptor).in_features
    return codes.new_empty((codes.shape[0], in_features), dtype=torch.float32)


def _attention_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, scale: float) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)
