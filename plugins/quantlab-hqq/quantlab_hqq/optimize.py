"""Calibration-free optimisation of affine zero points (and scales) by half-quadratic splitting.

Badri & Shaji 2023, "Half-Quadratic Quantization of Large Machine Learning Models" (HQQ).
For every group of weights `w` (one row of the `[..., group_size]` tensors below) with the
affine grid `Q(w) = clamp(round(w / s + z), 0, 2**bits - 1)` and `dequant(q) = (q - z) * s`,
HQQ looks for the zero point `z` (optionally also the scale `s`) minimising

    sum |w - dequant(Q(w))| ** p,      0 < p <= 1  (HQQ uses p = 0.7),

from the weights alone, no calibration data. The `l_p` norm (p < 1) lets a few large errors
stay large while the rest are fitted tightly. The problem is non-convex and non-smooth, so HQQ
splits it with an auxiliary error `e` coupled quadratically, `beta / 2 * |r - e|²`, to the
residual `r = w / s + z - Q(w)` (in grid steps), and alternates:

1. `e <- shrink_p(r)`, the proximal step of `|e|^p / beta` (generalised soft thresholding):
   residuals below `beta ** (-1 / (2 - p))` steps go to zero, larger ones are kept in `e`;
2. `z <- z - mean(r - e)`: the least-squares zero point once those outliers are set aside
   (with `optimize_scale`, the least-squares line `w - e*s ≈ (Q(w) - z) * s` in both);
3. `beta <- kappa * beta`.

Choices made here, each measured (perplexity and embedding quality; figures in benchmarks/RESULTS.md):
- The search starts from round-to-nearest's min-max scale with its zero point rounded to an
  integer (as the `hqq` package does at 4 bits, after AWQ), so a weight of 0 sits exactly on
  the grid. The iteration settles in the local optimum next to its start, and this start is
  the better one (at 3 bits by far, against the min-max start).
- The residual is measured in grid steps, so `beta` is dimensionless and the result does not
  depend on the weights' magnitude. The `hqq` package measures it in weight units, where its
  `beta = 10` zeroes every residual below 0.17: on LLM weights its shrinkage never acts and
  each step is a plain least-squares refit of the zero point. Here `beta = 1` keeps that
  behaviour for residuals within a grid step and caps the pull of clipped weights; stronger
  shrinkage (`beta` 10 to 100, sparser errors) measured worse perplexity.
- The last iterate is returned, as in the paper. (Keeping each group's best iterate under the
  `l_0.7` objective measured worse: it keeps round-to-nearest for groups that have many exact
  weights and a few bad ones.)
Everything is vectorised over all groups at once.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AffineParams:
    """Scale and zero point per group, `[...]` (the group dimension dropped), float32."""

    scale: torch.Tensor
    zero: torch.Tensor


def round_to_nearest_params(grouped: torch.Tensor, bits: int) -> AffineParams:
    """The min-max grid of round-to-nearest, `[..., group_size]` -> per-group scale and zero.

    A constant group gets scale 1 and zero `-w`, which represents it exactly.
    """
    qmax = (1 << bits) - 1
    low = grouped.amin(dim=-1)
    scale = (grouped.amax(dim=-1) - low) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return AffineParams(scale=scale, zero=-low / scale)


def initial_params(grouped: torch.Tensor, bits: int) -> AffineParams:
    """Where the search starts: the min-max scale with an integer zero point (0 on the grid).

    A constant group keeps round-to-nearest's exact representation.
    """
    params = round_to_nearest_params(grouped, bits)
    constant = grouped.amax(dim=-1) == grouped.amin(dim=-1)
    return AffineParams(scale=params.scale, zero=torch.where(constant, params.zero, params.zero.round()))


def quantize_codes(grouped: torch.Tensor, params: AffineParams, bits: int) -> torch.Tensor:
    """`Q(w) = clamp(round(w / s + z), 0, 2**bits - 1)`, as float codes."""
    qmax = (1 << bits) - 1
    scaled = grouped / params.scale.unsqueeze(-1) + params.zero.unsqueeze(-1)
    return scaled.round_().clamp_(0, qmax)


def dequantize_codes(codes: torch.Tensor, params: AffineParams) -> torch.Tensor:
    return (codes - params.zero.unsqueeze(-1)) * params.scale.unsqueeze(-1)


def lp_error(grouped: torch.Tensor, params: AffineParams, bits: int, lp_norm: float) -> torch.Tensor:
    """`sum |w - dequant(Q(w))|^p` per group: the objective HQQ minimises."""
    error = grouped - dequantize_codes(quantize_codes(grouped, params, bits), params)
    return error.abs_().pow_(lp_norm).sum(dim=-1)


def shrink_lp(x: torch.Tensor, beta: float, lp_norm: float) -> torch.Tensor:
    """Generalised soft thresholding, HQQ's proximal step of `|x|^p / beta` (exact for p = 1).

    `sign(x) * max(|x| - |x|^(p-1) / beta, 0)`: values with `|x| <= beta^(-1/(2-p))` become 0.
    """
    magnitude = x.abs()
    shrunk = magnitude - magnitude.clamp_min(torch.finfo(x.dtype).tiny).pow(lp_norm - 1) / beta
    return shrunk.clamp_min_(0).mul_(x.sign())


def inlier_part(residual: torch.Tensor, beta: float, lp_norm: float) -> torch.Tensor:
    """`r - shrink_p(r)`: the part of the residual the quadratic step fits.

    Residuals within the threshold `beta^(-1/(2-p))` count whole; beyond it, only
    `sign(r) * |r|^(p-1) / beta`. Only those (usually few) outliers pay for the power.
    """
    inliers = residual.clone()
    outliers = residual.abs() > beta ** (-1 / (2 - lp_norm))
    if outliers.any():
        values = residual[outliers]
        inliers[outliers] = values.abs().pow_(lp_norm - 1).div_(beta).mul_(values.sign())
    return inliers


def optimize_affine_params(
    grouped: torch.Tensor,
    bits: int,
    *,
    iterations: int = 20,
    lp_norm: float = 0.7,
    beta: float = 1.0,
    kappa: float = 1.01,
    optimize_scale: bool = False,
) -> AffineParams:
    """The HQQ grid (scale, zero point) of every group of `grouped` (`[..., group_size]`).

    `iterations` half-quadratic steps from `initial_params`; `iterations=0` returns that start.
    """
    weights = grouped.float()
    qmax = (1 << bits) - 1
    params = initial_params(weights, bits)
    scaled = weights / params.scale.unsqueeze(-1)
    for _ in range(iterations):
        shifted = scaled + params.zero.unsqueeze(-1)
        codes = shifted.round().clamp_(0, qmax)
        inliers = inlier_part(shifted.sub_(codes), beta, lp_norm)
        if optimize_scale:
            params = _refit_scale_and_zero(codes, inliers, params)
            scaled = weights / params.scale.unsqueeze(-1)
        else:
            params = AffineParams(scale=params.scale, zero=params.zero - inliers.mean(dim=-1))
        beta *= kappa
    return params


def _refit_scale_and_zero(codes: torch.Tensor, inliers: torch.Tensor, params: AffineParams) -> AffineParams:
    """Least-squares line through `(q, t)` with `t = w - e * s`, i.e. `t / s = q - z + inliers`.

    Its slope against `q` is `1 + cov(q, inliers) / var(q)` (the new scale over the old). A group
    whose codes are all equal, or whose fit would flip the grid, only refits its zero point.
    """
    code_mean = codes.mean(dim=-1, keepdim=True)
    centred = codes - code_mean
    variance = centred.square().sum(dim=-1)
    slope = 1 + (centred * inliers).sum(dim=-1) / variance
    usable = (variance > 0) & (slope > 0) & torch.isfinite(slope)
    slope = torch.where(usable, slope, torch.ones_like(slope))
    code_mean = code_mean.squeeze(-1)
    target_mean = code_mean - params.zero + inliers.mean(dim=-1)
    return AffineParams(scale=params.scale * slope, zero=code_mean - target_mean / slope)
