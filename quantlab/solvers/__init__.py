"""Solvers: how a layer's codes and grids are chosen, separate from how they are stored.

A solver takes a float weight and the layer's storage layout (and, for calibrated solvers,
statistics of the layer's inputs) and returns codes and group parameters on that layout's
grid, so every solver works with every format and the result is an ordinary checkpoint.

| solver | data | what it minimises |
| --- | --- | --- |
| `rtn` | none | nothing: round to nearest on the min-max (absmax) grid |
| `mse` | none (input statistics if given) | per-group squared error: clipping search, least-squares refit |
| `gptq` | calibration | layer-output error, through the inverse Hessian of the inputs (Frantar et al. 2022) |
| `reconstruct` | calibration | block-output error: a start solver's codes, then rounding and grids trained per block |

Outside packages add solvers through the entry-point group `quantlab.solvers` (a callable
that calls `register_solver`).
"""

from quantlab.solvers.base import InputStats, Solution, Solver
from quantlab.solvers.registry import get_solver, list_solvers, register_solver

__all__ = ["InputStats", "Solution", "Solver", "get_solver", "list_solvers", "register_solver"]
