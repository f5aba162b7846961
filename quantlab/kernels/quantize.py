"""Round-to-nearest steps as callers run them: the quantize op registered for the tensor's device
(`quantlab.kernels.register_quantize_op`), else the pure-torch definition in `quantlab.formats`.

Both give the same bits (tests/kernels/test_quantize_ops.py), so a result never depends on
whether the native library could be built; only the time does (about 1-2 ns per weight
natively against 5-30 ns in torch on CPU: quantize-on-load of a whole model).
"""

import torch

from quantlab.formats import affine, nf4, packing
from quantlab.formats.layout import INT8_OFFSET
from quantlab.kernels import quantize_op


def affine_quantize(
    weight: torch.Tensor, bits: int, group_size: int | None, symmetric: bool, scale_dtype: torch.dtype
) -> affine.AffineWeight:
    """`quantlab.formats.affine.quantize`."""
    native = _run("affine_quantize", weight, weight, bits, group_size, symmetric, scale_dtype)
    if native is not None:
        return affine.AffineWeight(*native)
    return affine.quantize(weight, bits, group_size, symmetric, scale_dtype)


def nf4_quantize(weight: torch.Tensor, blocksize: int, double_quant: bool) -> nf4.NF4Weight:
    """`quantlab.formats.nf4.quantize`."""
    native = _run("nf4_quantize", weight, weight, blocksize, nf4.midpoints(nf4.levels()))
    if native is None:
        return nf4.quantize(weight, blocksize, double_quant, bucketize=bucketize)
    codes, absmax = native
    return nf4.with_absmax(codes, absmax, double_quant, bucketize=bucketize)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`quantlab.formats.packing.pack`."""
    native = _run("pack", codes, codes, bits)
    return native if native is not None else packing.pack(codes, bits)


def bucketize(values: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """`quantlab.formats.nf4.bucketize`."""
    native = _run("bucketize", values, values, boundaries)
    return native if native is not None else nf4.bucketize(values, boundaries)


def offset_to_signed(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes `q + 128` as int8 `q` (the native op converts in place)."""
    native = _run("offset_to_signed", codes, codes)
    return native if native is not None else (codes.to(torch.int16) - INT8_OFFSET).to(torch.int8)


def count_nonfinite(values: torch.Tensor) -> int:
    """How many NaN/Inf values a float tensor holds (natively one pass and no temporary mask)."""
    native = _run("count_nonfinite", values, values)
    return native if native is not None else int((~torch.isfinite(values)).sum())


def _run(name: str, tensor: torch.Tensor, *args):
    op = quantize_op(name, tensor.device.type)
    return None if op is None else op(*args)
