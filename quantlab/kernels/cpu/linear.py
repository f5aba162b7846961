"""Fast CPU kernels for quantized Linear layers, registered for every built-in storage codec.

The native kernel decodes the codes in registers and multiplies as it goes. At one row
(decoding) the work is reading the weight, and 4-bit codes are 8x less memory traffic than fp32
weights. At many rows (prefill, training) the work is arithmetic; each block of 4 output features
is decoded once per block of rows (AVX2: panels of 16 features, 6 rows x 16 features a step). At
two rows and more a product may instead decode the weight (whole, or a tile of output features at
a time) and multiply it with torch's GEMM, where that was measured faster on this machine for the
layer's format, shape class and row count (`quantlab.kernels.cpu.tune`, `ql_product`).

The kernels run as torch operators (`ops.py`, `csrc/torch_ops.cpp`) when the extension builds,
else through ctypes. Either way gradients flow to the input through a backward pass that decodes
the weight again (nothing weight-sized is saved between passes), as the reference kernel does;
a weight over 4 MiB as float32 is decoded a tile of output features at a time, each tile multiplied
into the gradient while it is in cache (a fresh weight-sized buffer per call is mostly page faults;
timings in benchmarks/RESULTS.md).
When the native library cannot be built, every call goes to the reference kernel.
"""

import ctypes
from collections.abc import Iterator

import torch

from quantlab.formats.codec import native_codecs
from quantlab.kernels import register_kernel
from quantlab.kernels.cpu import native, ops, traced
from quantlab.kernels.cpu.weights import NativeWeight, describable, native_weight
from quantlab.kernels.reference import dequantize_matmul


class NativeKernelError(RuntimeError):
    """The native kernel rejected a weight description (a quantlab bug, not a user mistake)."""


def _check(status: int, what: str) -> None:
    if status:
        raise NativeKernelError(f"quantlab native {what} failed with status {status}")


def native_dequantize(weight: NativeWeight) -> torch.Tensor:
    """The float32 `[out, in]` weight, decoded by the native kernel (bit-identical to the reference)."""
    out = torch.empty(weight.out_features, weight.in_features, dtype=torch.float32)
    status = native.library().ql_dequantize(
        weight.pointer, 0, weight.out_features, out.data_ptr(), out.stride(0), torch.get_num_threads()
    )
    _check(status, "dequantize")
    return out


BACKWARD_WHOLE_BYTES = 4 << 20  # decoded whole up to this size (every SmolLM2 layer): the reference's sums
BACKWARD_TILE_BYTES = 2 << 20


def _decoded_tiles(weight: NativeWeight) -> Iterator[tuple[int, torch.Tensor]]:
    """(first feature, float32 rows) of the weight: whole up to BACKWARD_WHOLE_BYTES (every SmolLM2 layer),
    else tiles of output features of about BACKWARD_TILE_BYTES, decoded one after the other into one
    buffer that stays in cache (see the module doc)."""
    out_features, in_features = weight.out_features, weight.in_features
    if out_features * in_features * 4 <= BACKWARD_WHOLE_BYTES:
        yield 0, native_dequantize(weight)
        return
    lib, threads = native.library(), torch.get_num_threads()
    tile = max(4, BACKWARD_TILE_BYTES // (4 * in_features))
    buffer = torch.empty(tile, in_features)
    for first in range(0, out_features, tile):
        part = buffer[: min(tile, out_features - first)]
        _check(lib.ql_dequantize(weight.pointer, first, first + part.shape[0], part.data_ptr(), in_features, threads),
               "dequantize")  # fmt: skip
        yield first, part


def native_grad_input(weight: NativeWeight, grad: torch.Tensor) -> torch.Tensor:
    """`grad @ W` (float32), W decoded whole or a tile of output features at a time (see the module doc)."""
    flat = grad.reshape(-1, weight.out_features).float()
    result = None
    for first, part in _decoded_tiles(weight):
        columns = flat[:, first : first + part.shape[0]]
        result = columns @ part if result is None else result.addmm_(columns, part)
    return result.view(*grad.shape[:-1], weight.in_features)


def native_matmul(weight: NativeWeight, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`x @ W.T` for a 2-D float32 `x` whose rows are contiguous."""
    rows = x.shape[0]
    out = torch.empty(rows, weight.out_features)
    if rows:
        lib = lib or native.library()
        threads = torch.get_num_threads()
        status = lib.ql_gemm(weight.pointer, x.data_ptr(), rows, x.stride(0), out.data_ptr(), out.shape[1], threads)
        _check(status, "matmul")
    return out


def dequantized_matmul(weight: NativeWeight, x: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` for a 2-D float32 `x`, W decoded as the backward pass decodes it (`_decoded_tiles`) and
    multiplied by torch's GEMM: where it was measured faster than the fused kernel (`ql_product`)."""
    out = torch.empty(x.shape[0], weight.out_features)
    for first, part in _decoded_tiles(weight):
        torch.mm(x, part.T, out=out[:, first : first + part.shape[0]])
    return out


def _forward(weight: NativeWeight, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    flat = x if x.dim() == 2 else x.reshape(-1, weight.in_features)
    if flat.dtype != torch.float32 or flat.stride(-1) != 1:
        flat = flat.float().contiguous()
    lib = lib or native.library()
    if lib.ql_product(weight.pointer, flat.shape[0]) == native.PRODUCT_DECODED:  # as quantlab::linear chooses
        out = dequantized_matmul(weight, flat)
    else:
        out = native_matmul(weight, flat, lib)
    if x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)


class _NativeLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: NativeWeight) -> torch.Tensor:  # type: ignore[override]
        ctx.weight = weight
        return _forward(weight, x)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        return native_grad_input(ctx.weight, grad_output).to(grad_output.dtype), None


def native_linear(module, x: torch.Tensor) -> torch.Tensor:
    """The layer's output through the native kernels, or the reference kernel if they are unavailable.

    The kernels run as the torch operator `quantlab::linear` when its extension is available
    (one dispatcher call, traced by torch.compile), else through ctypes: directly in eager mode,
    under torch.compile as the Python operator `quantlab_ctypes::linear` (traced.py). A layer whose
    `activation_bits` is 8 runs as a group of one on `quantlab::linear_group` with int8 activations
    (eager calls on the extension; with gradients it stays on float inputs; compiled graphs get
    int8 activations from the fusion pass, generation/fusion.py).
    """
    if not x.is_cpu or not x.is_floating_point() or not describable(module.layout):
        return dequantize_matmul(module, x)
    if x.numel() > x.shape[-1] and not torch.compiler.is_compiling():  # many rows: the measured product
        _settle_products(module.layout)
    if ops.available():
        # eager calls only: a compiled graph gets int8 activations from the fusion pass (generation/fusion.py)
        bits = getattr(module, "activation_bits", 0)  # quantized tables used as an output head have none
        if bits and not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad):
            return ops.linear_group_op(x, *ops.group_arguments([module]), bits)
        return ops.linear_op(x, *ops.linear_arguments(module))
    if torch.compiler.is_compiling():  # dynamo must not trace the ctypes call nor its per-layer cache
        out = traced.linear(module, x) if traced.available() else None
    else:
        out = ctypes_linear(module, x)
    if out is None:
        return dequantize_matmul(module, x)
    if module.bias is not None:
        out = out + module.bias.to(out.dtype)
    return out


_tune = None  # quantlab.kernels.cpu.tune, imported at the first many-row call (so `python -m` runs it cleanly)


def _settle_products(layout) -> None:
    """This format's products at many rows, measured on this machine the first time (`tune.ensure_format`)."""
    global _tune
    lib = native.library()
    if lib is None:
        return
    if _tune is None:
        from quantlab.kernels.cpu import tune as _tune
    _tune.ensure_format(lib, layout.codec_object.native_kind, layout.bits)


def ctypes_linear(module, x: torch.Tensor) -> torch.Tensor | None:
    """`x @ W.T` through the C library called by ctypes (no bias), or None when it is unavailable."""
    lib = native.library()
    if lib is None:
        return None
    weight = native_weight(module)
    if torch.is_grad_enabled() and x.requires_grad:
        return _NativeLinear.apply(x, weight)
    return _forward(weight, x, lib)


for _codec in native_codecs():
    register_kernel(_codec, "cpu")(native_linear)
