"""Round to nearest on the min-max (absmax) grid of each group: the baseline every solver must beat."""

from typing import Any

import torch

from quantlab.formats import grouping
from quantlab.formats.layout import StorageLayout
from quantlab.solvers.base import InputStats, Solution, Solver


class RoundToNearest(Solver):
    name = "rtn"
    rounds_like_codec = True
    description = "round to nearest on each group's min-max grid (no data)"

    def solve(
        self, weight: torch.Tensor, layout: StorageLayout, stats: InputStats | None, options: dict[str, Any]
    ) -> Solution:
        grouped = grouping.group(weight.float(), layout.group_size)
        params = layout.fit(grouped)
        return Solution(layout.quantize_grouped(grouped, params), params)


SOLVER = RoundToNearest()
