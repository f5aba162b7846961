"""The solver contract and the input statistics calibrated solvers read."""

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from quantlab import distributed
from quantlab.formats.layout import GroupParams, StorageLayout


@dataclasses.dataclass
class Solution:
    """Codes `[out, groups, length]` (uint8 indices into the layout's grid) and their grids."""

    codes: torch.Tensor
    params: GroupParams


class InputStats:
    """Second moment of a Linear layer's inputs: `H = X^T X / n` (the GPTQ Hessian up to 2).

    Shared by every layer that reads the same input (q/k/v, gate/up), so it is computed once.
    Each batch's `X^T X` is a float32 product and the products are summed in float64, so the
    statistics of processes that each saw a share of the batches add up (`all_reduce`) to those
    of one process that saw them all (`quantlab.distributed` states the bound); the solvers read
    the float32 means.

    Memory, for `in` inputs: the float64 sum (8 in^2 bytes) while inputs are added, each batch's
    product made `PRODUCT_COLUMNS` columns at a time (no float32 `in x in` temporary beside it);
    the float32 mean (4 in^2) after `all_reduce`, made a slice of rows at a time before the sum is
    released (12 in^2 at that moment, never more); nothing once `release` is called.
    """

    PRODUCT_COLUMNS = 2048  # wider inputs: `X^T X` by column panels (the same float32 numbers, in practice)

    def __init__(self, in_features: int) -> None:
        self.gram: torch.Tensor | None = torch.zeros(in_features, in_features, dtype=torch.float64)  # sum x x^T
        self.count = 0
        self._hessian: torch.Tensor | None = None
        self._released = False

    def add(self, inputs: torch.Tensor) -> None:
        if self.gram is None:
            raise RuntimeError("these input statistics were reduced (all_reduce); start a new InputStats")
        rows = inputs.detach().reshape(-1, inputs.shape[-1]).float()
        width = rows.shape[1]
        if width <= self.PRODUCT_COLUMNS:
            self.gram.add_(rows.T @ rows)
        else:
            for start in range(0, width, self.PRODUCT_COLUMNS):
                end = min(start + self.PRODUCT_COLUMNS, width)
                self.gram[:, start:end].add_(rows.T @ rows[:, start:end])
        self.count += rows.shape[0]
        self._hessian = None

    def all_reduce(self) -> None:
        """Sum the statistics of every process calibrating together (nothing to sum alone), then keep
        only the float32 means: the float64 sums are released, and no input can be added after."""
        if self.gram is None:
            return
        self.gram = distributed.sum_(self.gram)
        self.count = distributed.total(self.count)
        self._hessian = _float32_mean(self.gram, self.count)
        self.gram = None

    def release(self) -> None:
        """Drop the `in x in` matrices (after the last layer reading this input is solved)."""
        self.gram, self._hessian, self._released = None, None, True

    @property
    def hessian(self) -> torch.Tensor:
        """`X^T X / n` in float32 (zeros before any input)."""
        if self._released:
            raise RuntimeError("these input statistics were released after their last layer was solved")
        if self._hessian is None:
            self._hessian = _float32_mean(self.gram, self.count)
        return self._hessian

    def transformed(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> "InputStats":
        """The statistics of inputs `x R` for an orthogonal `R`, from `transform(H) = R^T H R` (this one is kept)."""
        other = InputStats(0)
        other.gram, other.count = None, self.count
        other._hessian = transform(self.hessian)
        return other

    def channel_weights(self) -> torch.Tensor:
        """`E[x_j^2]` per input channel: how much an error in column j costs at the output."""
        return self.hessian.diagonal().clone()


def _float32_mean(gram: torch.Tensor, count: int, rows: int = 1024) -> torch.Tensor:
    """`(gram / count).float()`, the same numbers, made a slice of rows at a time (no second float64 matrix)."""
    mean = torch.empty(gram.shape, dtype=torch.float32)
    for start in range(0, gram.shape[0], rows):
        torch.div(gram[start : start + rows], max(count, 1), out=mean[start : start + rows])
    return mean


class Solver(ABC):
    """Chooses codes on a layout's grid. Subclasses set `name`; calibrated ones `needs_calibration`.

    `refines_blocks`: after the per-layer `solve`, the calibration schedule trains each block's
    layers jointly on the block's outputs (`quantlab.calibration.block_training`).
    """

    name: ClassVar[str]
    needs_calibration: ClassVar[bool] = False
    # The data-free solver that stands in for a calibrated one on layers no statistics reach (an untied head)
    data_free_substitute: ClassVar[str] = "mse"
    # Without statistics, the codes are the codec's own round-to-nearest (`QuantizedLinear.quantize_weight`)
    rounds_like_codec: ClassVar[bool] = False
    refines_blocks: ClassVar[bool] = False
    description: ClassVar[str] = ""

    def check_options(self, options: dict[str, Any]) -> None:  # noqa: B027 (optional: most solvers check when solving)
        """Raise `ConfigError` for invalid `solver_options` when the config is built."""

    def unsupported(self, layout: StorageLayout) -> str | None:
        """Why this solver cannot produce `layout`, or None when it can."""
        return None

    @abstractmethod
    def solve(
        self, weight: torch.Tensor, layout: StorageLayout, stats: InputStats | None, options: dict[str, Any]
    ) -> Solution:
        """Codes and grids for the float `[out, in]` weight."""
