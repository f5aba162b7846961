"""GPTQ (Frantar et al. 2022, arXiv 2210.17323): codes chosen column by column, each column's
rounding error spread over the columns not yet quantized through the inverse Hessian of the
layer's inputs, so the layer's output error, not the weight error, is what is minimised.

As in the reference implementation: the Hessian `H = X^T X / n` is dampened by `damp` times
its mean diagonal; its inverse is taken through Cholesky factors; columns are processed in
blocks of `block_size` with the updates of later columns batched per block (lazy batch
updates). With `act_order` columns go in order of decreasing `H_jj` (the most active input
channels first). Group grids are then fitted up front on the float weight ("static groups"),
so an act-order checkpoint stores its codes in the normal column order and layout; without
act order each group's grid is fitted when the solver reaches it, on the weight as updated
so far. NF4 under double quantization compresses all absmax of a layer together, so its
grids are always static. Codes are the nearest grid points of each format: the nearest NF4
level, the nearest integer for int8 and the affine widths.

A dead input channel (`H_jj = 0`: never active in calibration) gets `H_jj = 1`: its column
takes no error from others and is rounded as it stands (its weights still matter on other
data). A Hessian that stays singular after dampening is retried with ten times the
dampening (up to four times), then refused with an error.

Memory beside the statistics' float32 `in x in` Hessian: one float64 `in x in` buffer (the factor, see
`_inverse_cholesky`), the weight's columns in float32 (plus the float32 weight while they are reordered)
and its codes, and temporaries of at most `UPDATE_ROWS` rows: 8 in^2 + 8 in out bytes, 8.5 GB for a
70B model's down projection (28,672 inputs, 8,192 outputs). The factorization and the batched updates
use every thread; the column steps one.
"""

from typing import Any

import torch

from quantlab.errors import ConfigError, QuantizationError
from quantlab.formats import grouping
from quantlab.formats.layout import GroupParams, StorageLayout
from quantlab.solvers.base import InputStats, Solution, Solver
from quantlab.solvers.mse import search_grid
from quantlab.utils.threads import single_thread

# static_groups None: static with act order. grid "mse": each group's grid from the input-weighted
# clipping search of the mse solver (GPTQ's reference code has the same option); "minmax": min-max.
# grid None: "mse" below 8 bits, "minmax" at 8 bits, where 255 levels leave the search nothing to
# gain and its clipping cost SmolLM2 int8 0.06 perplexity (36.102 against 36.046 with min-max).
DEFAULTS = {"damp": 0.01, "act_order": True, "block_size": 128, "static_groups": None, "grid": None}
_DAMP_RETRIES = 4
UPDATE_ROWS = 4096  # later columns updated per product after each block: a bounded temporary, the same numbers


class GptqSolver(Solver):
    name = "gptq"
    needs_calibration = True
    description = "GPTQ: inverse-Hessian error feedback on calibration inputs (act order, static groups)"

    def solve(
        self, weight: torch.Tensor, layout: StorageLayout, stats: InputStats | None, options: dict[str, Any]
    ) -> Solution:
        if stats is None:
            raise QuantizationError("the gptq solver needs calibration inputs; pass calibration data")
        damp, act_order, block_size, static, grid = _options(options)
        static = static or act_order or layout.fits_groups_together
        grid = grid or ("minmax" if layout.bits >= 8 else "mse")
        return self._solve(weight, layout, stats, damp, act_order, block_size, static, grid)

    def _solve(
        self,
        weight: torch.Tensor,
        layout: StorageLayout,
        stats: InputStats,
        damp: float,
        act_order: bool,
        block_size: int,
        static: bool,
        grid: str,
    ) -> Solution:
        W = weight.detach().float()  # read only: the column sweep works on its own copy
        diagonal = stats.hessian.diagonal().double()
        dead = diagonal == 0
        diagonal[dead] = 1.0
        order = torch.argsort(diagonal, descending=True) if act_order else torch.arange(layout.in_features)
        grids = _Grids(layout, W, order, static, stats.channel_weights() if grid == "mse" else None)
        inverse = _inverse_cholesky(stats.hessian, order, dead[order], damp)
        # Columns of W as contiguous rows: each step reads and updates whole rows.
        columns = W.T.index_select(0, order)
        del W
        codes = torch.empty(columns.shape, dtype=torch.uint8)
        for start in range(0, layout.in_features, block_size):
            end = min(start + block_size, layout.in_features)
            block = columns[start:end].clone()
            errors = torch.empty_like(block)
            block_inverse = inverse[start:end, start:end]
            with single_thread():  # hundreds of small steps: a second thread costs more than it gives
                for i in range(end - start):
                    scale, zero = grids.at(start + i, block[i:], columns[end:])
                    column = block[i]
                    q = layout.encode(column, scale, zero)
                    codes[start + i] = q
                    error = (column - layout.decode(q, scale, zero)) / block_inverse[i, i]
                    block[i:].addr_(block_inverse[i, i:], error, alpha=-1)
                    errors[i] = error
            for rows in range(end, layout.in_features, UPDATE_ROWS):  # the later columns, a slice at a time
                last = min(rows + UPDATE_ROWS, layout.in_features)
                columns[rows:last].sub_(inverse[start:end, rows:last].T @ errors)
        codes = codes.T
        unpermuted = torch.empty_like(codes)
        unpermuted[:, order] = codes
        return Solution(grouping.group(unpermuted, layout.group_size), grids.collected())


class _Grids:
    """Each column's grid: static (all fitted up front on the float weight) or fitted per group
    when its first column is reached, on the weight as updated so far (columns in order)."""

    def __init__(
        self, layout: StorageLayout, W: torch.Tensor, order: torch.Tensor, static: bool, importance: torch.Tensor | None
    ) -> None:
        self.layout = layout
        self.group_of = (order // layout.group_length).tolist()
        self.importance = importance  # E[x_j^2] per input channel for the mse grid search, None for min-max
        self.static = self._fit(grouping.group(W, layout.group_size), 0) if static else None
        self.fitted: list[GroupParams] = []
        if self.static is not None:  # each group's grid as a contiguous row (a group's, not a column's: in/length rows)
            self.group_scale = self.static.scale.T.contiguous()
            zero = self.static.zero
            self.group_zero = None if zero is None else zero.T.contiguous()

    def _fit(self, grouped: torch.Tensor, first_column: int) -> GroupParams:
        if self.importance is None:
            return self.layout.fit(grouped)
        columns = grouped.shape[1] * grouped.shape[2]
        weights = torch.zeros(columns)
        real = self.importance[first_column : first_column + columns]
        weights[: real.numel()] = real
        return search_grid(grouped, self.layout, weights.view(1, grouped.shape[1], grouped.shape[2]))

    def at(
        self, column: int, in_block: torch.Tensor, after_block: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale and zero `[out]` of the column at position `column`, whose current weights onwards
        are `in_block` (the rest of its block) then `after_block` (the later columns), one row per column."""
        if self.static is not None:
            group = self.group_of[column]
            return self.group_scale[group], None if self.group_zero is None else self.group_zero[group]
        length = self.layout.group_length
        if column % length == 0:
            count = min(length, self.layout.in_features - column)
            values = torch.cat([in_block, after_block[: max(0, count - in_block.shape[0])]], dim=0)[:count].T
            self.fitted.append(self._fit(grouping.group(values, length), column))
        latest = self.fitted[-1]
        return latest.scale[:, 0], None if latest.zero is None else latest.zero[:, 0]

    def collected(self) -> GroupParams:
        if self.static is not None:
            return self.static
        scale = torch.cat([params.scale for params in self.fitted], dim=1)
        zero = None if self.fitted[0].zero is None else torch.cat([params.zero for params in self.fitted], dim=1)
        return self.layout.grid(scale, zero)


def _inverse_cholesky(hessian: torch.Tensor, order: torch.Tensor, dead: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor (float32) of `(H + damp * mean(diag H) * I)^-1` for `H` the float32 `hessian` in
    `order` with its `dead` diagonal set to 1; more dampening if singular.

    One float64 `in x in` buffer (8 in^2 bytes) holds H, then its factor, the inverse, the inverse's factor,
    and last that factor rounded to float32: LAPACK works in place on a column-major matrix, so each step
    writes over the last, and the float32 numbers fill the buffer's first half. The steps and their inputs
    are those of out-of-place calls, bit for bit.
    """
    for attempt in range(_DAMP_RETRIES + 1):
        matrix = _permuted_float64(hessian, order)
        matrix.diagonal()[dead] = 1.0
        matrix.diagonal().add_(damp * (10**attempt) * matrix.diagonal().mean())
        info = torch.empty((), dtype=torch.int32)
        torch.linalg.cholesky_ex(matrix, out=(matrix, info))
        if info == 0:
            torch.cholesky_inverse(matrix, out=matrix)
            torch.linalg.cholesky_ex(matrix, upper=True, out=(matrix, info))
            if info == 0:
                return _rounded_in_place(matrix)
        del matrix
    raise QuantizationError(
        f"gptq: the calibration Hessian stays singular with dampening up to {damp * 10**_DAMP_RETRIES:g}; "
        f"use more (or more varied) calibration samples, or the mse solver for this model"
    )


def _rounded_in_place(matrix: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """`matrix.float()` for a column-major float64 `matrix`, written over the first half of its own storage.

    Storage row j (column j of the matrix) goes to float32 bytes `[4 n j, 4 n (j + 1))`, inside float64 rows
    `<= j`: every slice of rows is read whole before it is written, so nothing is overwritten unread."""
    size = matrix.shape[0]
    storage = matrix.mT  # row-major view: row j is the matrix's column j
    halves = storage.reshape(-1).view(torch.float32)[: size * size].view(size, size)
    for start in range(0, size, rows):
        halves[start : start + rows] = storage[start : start + rows].float()
    return halves.mT


def _permuted_float64(hessian: torch.Tensor, order: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """`hessian[order][:, order]` in float64 as a column-major matrix (what LAPACK takes in place), filled a
    slice of columns at a time so no second full-size copy exists."""
    size = order.numel()
    storage = torch.empty(size, size, dtype=torch.float64)  # row j of `storage` is column j of the matrix
    for start in range(0, size, rows):
        columns = order[start : start + rows]
        storage[start : start + rows] = hessian.index_select(1, columns).index_select(0, order).T
    return storage.mT


def _options(options: dict[str, Any]) -> tuple[float, bool, int, bool | None]:
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"gptq solver: unknown option(s) {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    merged = {**DEFAULTS, **options}
    damp, act_order, block_size, static = (merged[k] for k in ("damp", "act_order", "block_size", "static_groups"))
    if isinstance(damp, bool) or not isinstance(damp, int | float) or not 0 < damp < 1:
        raise ConfigError(f"gptq solver: damp={damp!r} must be a number in (0, 1); GPTQ uses 0.01")
    if not isinstance(act_order, bool):
        raise ConfigError(f"gptq solver: act_order={act_order!r} must be true or false")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"gptq solver: block_size={block_size!r} must be a whole number >= 1")
    if static is not None and not isinstance(static, bool):
        raise ConfigError(f"gptq solver: static_groups={static!r} must be true, false or null")
    if act_order and static is False:
        raise ConfigError("gptq solver: act_order needs static_groups (so the checkpoint keeps its layout)")
    if merged["grid"] not in (None, "mse", "minmax"):
        raise ConfigError(f"gptq solver: grid={merged['grid']!r} must be 'mse', 'minmax' or null (by width)")
    return float(damp), act_order, block_size, bool(static), merged["grid"]


SOLVER = GptqSolver()
