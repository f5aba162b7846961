"""The solver contract and the input statistics calibrated solvers read."""

import dataclasses
from abc import ABC, abstractmethod
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
    """Second moment of a Linear layer's inputs: `H = X^T X / n` (the GPTQ Hessian up to 2),
    and the mean absolute activation per input channel (for activation-aware scaling).

    Shared by every layer that reads the same input (q/k/v, gate/up), so it is computed once.
    Each batch's `X^T X` is a float32 product and the products are summed in float64, so the
    statistics of processes that each saw a share of the batches add up (`all_reduce`) to those
    of one process that saw them all (`quantlab.distributed` states the bound); the solvers read
    the float32 means.
    """

    def __init__(self, in_features: int) -> None:
        self.gram: torch.Tensor | None = torch.zeros(in_features, in_features, dtype=torch.float64)  # sum x x^T
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.count = 0
        self._hessian: torch.Tensor | None = None

    def add(self, inputs: torch.Tensor) -> None:
        if self.gram is None:
            raise RuntimeError("these input statistics were reduced (all_reduce); start a new InputStats")
        rows = inputs.detach().reshape(-1, inputs.shape[-1]).float()
        self.gram.add_(rows.T @ rows)
        self.abs_sum.add_(rows.abs().sum(dim=0))
        self.count += rows.shape[0]
        self._hessian = None

    def all_reduce(self) -> None:
        """Sum the statistics of every process calibrating together (nothing to sum alone), then keep
        only the float32 means: the float64 sums are released, and no input can be added after."""
        if self.gram is None:
            return
        self.gram, self.abs_sum = distributed.sum_(self.gram), distributed.sum_(self.abs_sum)
        self.count = distributed.total(self.count)
        self._hessian = (self.gram / max(self.count, 1)).float()
        self.gram = None

    @property
    def hessian(self) -> torch.Tensor:
        """`X^T X / n` in float32 (zeros before any input)."""
        if self._hessian is None:
            self._hessian = (self.gram / max(self.count, 1)).float()
        return self._hessian

    @property
    def abs_mean(self) -> torch.Tensor:
        return (self.abs_sum / max(self.count, 1)).float()

    def channel_weights(self) -> torch.Tensor:
        """`E[x_j^2]` per input channel: how much an error in column j costs at the output."""
        return self.hessian.diagonal().clone()


class Solver(ABC):
    """Chooses codes on a layout's grid. Subclasses set `name`; calibrated ones `needs_calibration`.

    `refines_blocks`: after the per-layer `solve`, the calibration schedule trains each block's
    layers jointly on the block's outputs (`quantlab.calibration.reconstruction`).
    """

    name: ClassVar[str]
    needs_calibration: ClassVar[bool] = False
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
