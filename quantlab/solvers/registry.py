"""Solver names → solvers; built-ins registered on first use, plugins through entry points."""

import re

from quantlab.errors import ConfigError
from quantlab.solvers.base import Solver
from quantlab.utils.entry_points import load_entry_points

ENTRY_POINT_GROUP = "quantlab.solvers"
_NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")
_SOLVERS: dict[str, Solver] = {}
_discovered = False


def register_solver(solver: Solver) -> Solver:
    """Add `solver` under `solver.name`; another solver of that name raises."""
    name = solver.name
    if not _NAME_PATTERN.match(name or ""):
        raise ValueError(f"solver name {name!r} must be lowercase letters, digits and underscores")
    existing = _SOLVERS.get(name)
    if existing is not None and type(existing) is not type(solver):
        raise ValueError(f"a solver named {name!r} is already registered ({type(existing).__name__})")
    _SOLVERS[name] = solver
    return solver


def get_solver(name: str) -> Solver:
    """The solver registered under `name`; an unknown name raises `ConfigError` listing the known ones."""
    _discover()
    solver = _SOLVERS.get(name)
    if solver is None:
        raise ConfigError(f"unknown solver {name!r}; known solvers: {', '.join(list_solvers())}")
    return solver


def list_solvers() -> list[str]:
    _discover()
    return sorted(_SOLVERS)


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    from quantlab.solvers import gptq, mse, reconstruct, rtn  # the built-ins register on first use, as plugins do

    for module in (rtn, mse, gptq, reconstruct):
        register_solver(module.SOLVER)
    load_entry_points(ENTRY_POINT_GROUP, "solver plugin")
