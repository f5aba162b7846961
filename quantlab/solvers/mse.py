"""Data-free MSE solver: per-group clipping search, then least-squares refits of each grid.

Round-to-nearest spends its grid on the group's extreme weights; shrinking the range (the
clipping search of AWQ's `auto_clip` and llama.cpp's k-quants) trades a larger error on a
few outliers for a finer grid everywhere else. For each group the solver tries `grid` ratios
from 1 down to `min_clip`, keeps the one with the least squared error, then alternates
"codes given the grid" and "grid given the codes" (closed-form weighted least squares for the
scale, and for the zero point where one is stored), keeping a refit only where it lowers the
group's error. With input statistics (calibration) the error of column j is weighted by
`E[x_j^2]`, the cost of that column's error at the layer output; without them all columns
count alike, so the solver needs no data and runs while `from_pretrained` loads.
"""

from typing import Any

import torch

from quantlab.errors import ConfigError
from quantlab.formats import grouping
from quantlab.formats.layout import GroupParams, StorageLayout
from quantlab.solvers.base import InputStats, Solution, Solver

DEFAULTS = {"grid": 20, "min_clip": 0.5, "refits": 4}
SEARCH_WEIGHTS = 1 << 22  # weights searched at once: the search's temporaries are a few float copies of them


class MseSolver(Solver):
    name = "mse"
    description = "data-free: per-group clipping search and least-squares grid refits (input-weighted with data)"

    def solve(
        self, weight: torch.Tensor, layout: StorageLayout, stats: InputStats | None, options: dict[str, Any]
    ) -> Solution:
        grid, min_clip, refits = _options(options)
        grouped = grouping.group(weight.float(), layout.group_size)
        importance = column_importance(layout, None if stats is None else stats.channel_weights())
        params = search_grid(grouped, layout, importance, grid, min_clip, refits)
        return Solution(layout.quantize_grouped(grouped, params), params)


def search_grid(
    grouped: torch.Tensor,
    layout: StorageLayout,
    importance: torch.Tensor,
    grid: int = DEFAULTS["grid"],
    min_clip: float = DEFAULTS["min_clip"],
    refits: int = DEFAULTS["refits"],
) -> GroupParams:
    """The grids of grouped weights `[out, groups, length]` with the least importance-weighted error.

    Each group's search depends on that group alone, so rows go `SEARCH_WEIGHTS` weights at a time
    (the same grids, temporaries bounded), except where a codec fits all of a layer's grids together
    (`StorageLayout.fits_groups_together`: NF4's double quantization)."""
    rows = max(1, SEARCH_WEIGHTS // max(1, grouped.shape[1] * grouped.shape[2]))
    if layout.fits_groups_together or grouped.shape[0] <= rows:
        return _search_rows(grouped, layout, importance, grid, min_clip, refits)
    parts = [
        _search_rows(grouped[start : start + rows], layout, importance, grid, min_clip, refits)
        for start in range(0, grouped.shape[0], rows)
    ]
    zero = None if parts[0].zero is None else torch.cat([part.zero for part in parts])
    return GroupParams(torch.cat([part.scale for part in parts]), zero)


def _search_rows(
    grouped: torch.Tensor, layout: StorageLayout, importance: torch.Tensor, grid: int, min_clip: float, refits: int
) -> GroupParams:
    params, error = _clip_search(grouped, layout, importance, grid, min_clip)
    for _ in range(refits):
        codes = layout.quantize_grouped(grouped, params)
        candidate = _least_squares_grid(grouped, codes, layout, importance, params)
        better = _error(grouped, candidate, layout, importance) < error
        if not better.any():
            break
        params = _choose(layout, better, candidate, params)
        error = _error(grouped, params, layout, importance)
    return params


def column_importance(layout: StorageLayout, channel_weights: torch.Tensor | None) -> torch.Tensor:
    """Weight of each position `[1, groups, length]`: E[x_j^2] (or 1 without data), and 0 on padding."""
    return grouping.position_weights(layout.in_features, layout.group_size, channel_weights)


def _options(options: dict[str, Any]) -> tuple[int, float, int]:
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"mse solver: unknown option(s) {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    merged = {**DEFAULTS, **options}
    grid, min_clip, refits = merged["grid"], merged["min_clip"], merged["refits"]
    if not isinstance(grid, int) or grid < 1:
        raise ConfigError(f"mse solver: grid={grid!r} must be a whole number >= 1")
    if not isinstance(min_clip, int | float) or not 0 < min_clip <= 1:
        raise ConfigError(f"mse solver: min_clip={min_clip!r} must be in (0, 1]")
    if not isinstance(refits, int) or refits < 0:
        raise ConfigError(f"mse solver: refits={refits!r} must be a whole number >= 0")
    return grid, float(min_clip), refits


def _error(grouped: torch.Tensor, params: GroupParams, layout: StorageLayout, importance: torch.Tensor) -> torch.Tensor:
    codes = layout.quantize_grouped(grouped, params)
    zero = None if params.zero is None else params.zero.unsqueeze(-1)
    values = layout.decode(codes, params.scale.unsqueeze(-1), zero)
    return ((grouped - values).square() * importance).sum(dim=-1)


def _clip_search(
    grouped: torch.Tensor, layout: StorageLayout, importance: torch.Tensor, grid: int, min_clip: float
) -> tuple[GroupParams, torch.Tensor]:
    """Per group, the clipping ratio (and, on signed grids, the scale's sign) with the least error."""
    best_clip = torch.ones(grouped.shape[:2])
    best_error = torch.full(grouped.shape[:2], float("inf"))
    best_signed = torch.zeros(grouped.shape[:2], dtype=torch.bool)
    for signed in (False, True) if layout.signed_grids else (False,):
        for ratio in torch.linspace(1.0, min_clip, grid).tolist():
            error = _error(grouped, layout.fit(grouped, ratio, signed=signed), layout, importance)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_clip = torch.where(better, torch.full_like(best_clip, ratio), best_clip)
            best_signed = torch.where(better, signed, best_signed)
    params = layout.fit(grouped, best_clip)
    if best_signed.any():
        signed_params = layout.fit(grouped, best_clip, signed=True)
        params = layout.grid(torch.where(best_signed, signed_params.scale, params.scale))
    return params, _error(grouped, params, layout, importance)


def _least_squares_grid(
    grouped: torch.Tensor, codes: torch.Tensor, layout: StorageLayout, importance: torch.Tensor, current: GroupParams
) -> GroupParams:
    """The grid minimising the weighted squared error for fixed codes (closed form per group)."""
    levels = layout.levels(grouped.device)
    level = codes.float() if levels is None else levels[codes.long()]
    w = importance.expand_as(grouped)
    total = w.sum(dim=-1).clamp(min=1e-30)
    if layout.has_zero:
        # x ≈ s * level + m with m = -s * zero: weighted linear regression.
        mean_l = (w * level).sum(-1) / total
        mean_x = (w * grouped).sum(-1) / total
        dl = level - mean_l.unsqueeze(-1)
        var = (w * dl.square()).sum(-1)
        scale = (w * dl * (grouped - mean_x.unsqueeze(-1))).sum(-1) / var.clamp(min=1e-30)
        valid = (var > 1e-30) & (scale > 0) & torch.isfinite(scale)
        scale = torch.where(valid, scale, current.scale)
        zero = torch.where(valid, (mean_l * scale - mean_x) / scale, current.zero)
        return layout.grid(scale, zero)
    centred = level - layout.constant_zero
    denominator = (w * centred.square()).sum(-1)
    scale = (w * centred * grouped).sum(-1) / denominator.clamp(min=1e-30)
    # On signed grids the fitted scale keeps the sign of the codes' orientation.
    nonzero = scale != 0 if layout.signed_grids else scale > 0
    valid = (denominator > 1e-30) & nonzero & torch.isfinite(scale)
    return layout.grid(torch.where(valid, scale, current.scale))


def _choose(layout: StorageLayout, better: torch.Tensor, candidate: GroupParams, current: GroupParams) -> GroupParams:
    scale = torch.where(better, candidate.scale, current.scale)
    zero = None if current.zero is None else torch.where(better, candidate.zero, current.zero)
    return layout.grid(scale, zero)


SOLVER = MseSolver()
