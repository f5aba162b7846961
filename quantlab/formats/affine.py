"""Group-wise affine (asymmetric) and symmetric integer quantization, 2 to 8 bits.

Symmetric: `w ≈ (q - 2**(b-1)) * scale`, `scale = absmax / (2**(b-1) - 1)`, so zero is exact.
Asymmetric: `w ≈ (q - zero) * scale`, `scale = (max - min) / (2**b - 1)`, `zero = -min / scale`
kept as a float (no rounding of the zero point, the layout of onnxruntime's MatMulNBits).
Codes are unsigned `0 <= q < 2**b`; the dequantization error of each weight is at most
`scale / 2`, the round-to-nearest bound.
"""

from dataclasses import dataclass

import torch

from quantlab.formats import grouping


@dataclass
class AffineWeight:
    """Codes `[out, groups, group_size]` (uint8), scale and optional zero `[out, groups]`."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None


def quantize(
    weight: torch.Tensor,
    bits: int,
    group_size: int | None,
    symmetric: bool,
    scale_dtype: torch.dtype = torch.float32,
) -> AffineWeight:
    """Round-to-nearest quantization of a `[out, in]` matrix, scales stored in `scale_dtype`.

    The definition; `quantlab.kernels.quantize.affine_quantize` runs a bit-identical native op
    when one is registered for the weight's device.
    """
    grouped = grouping.group(weight.float(), group_size)
    if symmetric:
        return _quantize_symmetric(grouped, bits, scale_dtype)
    return _quantize_asymmetric(grouped, bits, scale_dtype)


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    in_features: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Float `[out, in]` matrix from grouped codes; the reference every kernel must match."""
    zero_point = zero.float().unsqueeze(-1) if zero is not None else float(1 << (bits - 1))
    values = (codes.float() - zero_point) * scale.float().unsqueeze(-1)
    return grouping.ungroup(values, in_features).to(dtype)


def _quantize_symmetric(grouped: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> AffineWeight:
    qmax = (1 << (bits - 1)) - 1
    scale = _stored_scale(grouped.abs().amax(dim=-1) / qmax, scale_dtype)
    q = torch.round(grouped / scale.float().unsqueeze(-1)).clamp_(-qmax, qmax)
    codes = (q + (1 << (bits - 1))).to(torch.uint8)
    return AffineWeight(codes=codes, scale=scale, zero=None)


def _quantize_asymmetric(grouped: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> AffineWeight:
    qmax = (1 << bits) - 1
    low = grouped.amin(dim=-1)
    high = grouped.amax(dim=-1)
    scale = _stored_scale((high - low) / qmax, scale_dtype)
    zero = (-low / scale.float()).to(scale_dtype)
    q = torch.round(grouped / scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1))
    codes = q.clamp_(0, qmax).to(torch.uint8)
    return AffineWeight(codes=codes, scale=scale, zero=zero)


def _stored_scale(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Cast to the storage dtype first, so codes are computed with the scale that is kept.

    A group of zeros (or one whose scale underflows) gets scale 1: its codes are then exact.
    """
    stored = scale.to(scale_dtype)
    return torch.where(stored == 0, torch.ones_like(stored), stored)
