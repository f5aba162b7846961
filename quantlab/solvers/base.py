"""The solver contract and the input statistics calibrated solvers read."""

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from quantlab.formats.layout import GroupParams, StorageLayout


@dataclasses.dataclass
class Solution:
    """Codes `[out, groups, length]` (uint8 indices into the layout's grid) and their grids."""

    codes: torch.Tensor
    params: GroupParams


class InputStats:
    """Running second moment of a Linear layer's inputs: `H = X^T X / n` (the GPTQ Hessian up to 2),
    and the mean absolute activation per input channel (for activation-aware scaling).

    Shared by every layer that reads the same input (q/k/v, gate/up), so it is computed once.
    """

    def __init__(self, in_features: int) -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.abs_mean = torch.zeros(in_features, dtype=torch.float32)
        self.count = 0

    def add(self, inputs: torch.Tensor) -> None:
        rows = inputs.detach().reshape(-1, inputs.shape[-1]).float()
        total = self.count + rows.shape[0]
        self.hessian.mul_(self.count / total).addmm_(rows.T, rows, alpha=1.0 / total)
        self.abs_mean.mul_(self.count / total).add_(rows.abs().sum(dim=0), alpha=1.0 / total)
        self.count = total

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
