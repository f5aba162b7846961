"""NormalFloat-4 with optional double quantization (Dettmers et al., QLoRA, arXiv 2305.14314).

Each block of `blocksize` weights is divided by its absmax and mapped to the nearest of the
16 NF4 levels (quantiles of a standard normal, rescaled to [-1, 1]); the nearest level is
found by bucketing against the midpoints, as bitsandbytes does, so the codes equal theirs.
Double quantization stores the per-block absmax in 8 bits: the mean is subtracted and the
rest is quantized in blocks of 256 with bitsandbytes' signed dynamic 8-bit map, each block
keeping one float32 scale. That costs 8/64 + 32/(64*256) bits per weight at blocksize 64.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from quantlab.formats import grouping

NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
ABSMAX_BLOCKSIZE = 256
Bucketize = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class NF4Weight:
    """4-bit codes `[out, blocks, blocksize]` and the per-block absmax, plain or compressed."""

    codes: torch.Tensor
    absmax: torch.Tensor | None = None
    absmax_codes: torch.Tensor | None = None
    absmax_scale: torch.Tensor | None = None
    absmax_offset: torch.Tensor | None = None


def bucketize(values: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """Bucket index (int32) of each value among sorted `boundaries`; ties go to the lower bucket."""
    return torch.bucketize(values, boundaries, out_int32=True)


def levels(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


@torch.compiler.assume_constant_result
def dynamic_map() -> tuple[float, ...]:
    """The signed dynamic 8-bit map of Dettmers (arXiv 1511.04561), as bitsandbytes builds it.

    A constant to torch.compile: the reference kernel decodes double-quantized absmax inside the
    compiled decode step, and dynamo would otherwise trace the construction below (it ignores
    `functools.cache`), whose `tolist()` it cannot.
    """
    return _build_dynamic_map()


@cache
def _build_dynamic_map() -> tuple[float, ...]:
    max_exponent_bits, non_sign_bits = 7, 7
    values: list[float] = []
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = ((boundaries[:-1] + boundaries[1:]) / 2.0).tolist()
        magnitude = 10 ** (-(max_exponent_bits - 1) + i)
        values += [magnitude * m for m in means] + [-magnitude * m for m in means]
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return tuple(sorted(values))


def quantize(
    weight: torch.Tensor,
    blocksize: int,
    double_quant: bool,
    absmax_blocksize: int = ABSMAX_BLOCKSIZE,
    bucketize: Bucketize = bucketize,
) -> NF4Weight:
    """NF4 codes of a `[out, in]` matrix in blocks of `blocksize` along each row.

    The definition; `quantlab.kernels.quantize.nf4_quantize` runs a bit-identical native op
    when one is registered for the weight's device (and passes its native `bucketize`).
    """
    blocks = grouping.group(weight.float(), blocksize)
    absmax = blocks.abs().amax(dim=-1)
    scaled = (blocks / absmax.clamp(min=1e-38).unsqueeze(-1)).clamp_(-1, 1)
    codes = bucketize(scaled, midpoints(levels(weight.device))).to(torch.uint8)
    return with_absmax(codes, absmax, double_quant, absmax_blocksize, bucketize)


def with_absmax(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    double_quant: bool,
    absmax_blocksize: int = ABSMAX_BLOCKSIZE,
    bucketize: Bucketize = bucketize,
) -> NF4Weight:
    """The NF4 weight of `codes` chosen against `absmax`: the absmax as is, or in 8 bits (double quant)."""
    if not double_quant:
        return NF4Weight(codes=codes, absmax=absmax)
    absmax_codes, absmax_scale, offset = quantize_absmax(absmax, absmax_blocksize, bucketize)
    return NF4Weight(codes=codes, absmax_codes=absmax_codes, absmax_scale=absmax_scale, absmax_offset=offset)


def quantize_absmax(
    absmax: torch.Tensor, blocksize: int, bucketize: Bucketize = bucketize
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Second level: `absmax - mean` in blocks of `blocksize` with the dynamic 8-bit map."""
    offset = absmax.mean().reshape(1)
    centred = _blocks(absmax - offset, blocksize)
    scale = centred.abs().amax(dim=-1)
    scaled = (centred / scale.clamp(min=1e-38).unsqueeze(-1)).clamp_(-1, 1)
    code_map = torch.tensor(dynamic_map(), dtype=torch.float32, device=absmax.device)
    codes = bucketize(scaled, midpoints(code_map)).to(torch.uint8)
    return codes.reshape(-1)[: absmax.numel()].reshape(absmax.shape), scale, offset


def dequantize_absmax(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, blocksize: int) -> torch.Tensor:
    code_map = torch.tensor(dynamic_map(), dtype=torch.float32, device=codes.device)
    values = _blocks(code_map[codes.long()], blocksize) * scale.float().unsqueeze(-1)
    return values.reshape(-1)[: codes.numel()].reshape(codes.shape) + offset.float()


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """Float `[out, in]` matrix from NF4 codes and float absmax; the reference for kernels."""
    values = levels(codes.device)[codes.long()] * absmax.float().unsqueeze(-1)
    return grouping.ungroup(values, in_features).to(dtype)


def midpoints(sorted_levels: torch.Tensor) -> torch.Tensor:
    """Boundaries between neighbouring levels: a value's nearest level is its bucket among these."""
    return (sorted_levels[:-1] + sorted_levels[1:]) / 2


def _blocks(values: torch.Tensor, blocksize: int) -> torch.Tensor:
    flat = values.reshape(-1).float()
    padding = -flat.numel() % blocksize
    return torch.nn.functional.pad(flat, (0, padding)).reshape(-1, blocksize)
