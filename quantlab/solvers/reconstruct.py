"""Block-wise reconstruction: a start solver's codes, then each block's layers tuned jointly on its outputs.

Per-layer solvers (GPTQ included) minimise each layer's own output error, one layer at a time,
and keep the grid they fitted. Below 4 bits the methods that hold up optimise a whole block
against the float model's outputs instead: AutoRound (Cheng et al., arXiv 2309.05516: signed
gradient descent on rounding offsets and clipping, ~200 steps a block), OmniQuant (Shao et al.,
arXiv 2308.13137: learnable weight clipping), EfficientQAT's Block-AP (Chen et al., arXiv
2407.11062: weights and scales trained block by block).

This solver's per-layer step is its `start` solver (GPTQ by default); the calibration schedule
(`quantlab.calibration.block_training`) then trains every quantized layer of the block at once
through a straight-through fake quantizer on the layer's own storage format
(`quantlab.nn.fake_quant`: rounding offsets, scales, zero points), minimising the squared error of
the block's output on mini-batches of the calibration windows, keeps the best step, and stores
the result as ordinary codes and grids. Every codec with a per-group grid and every width works,
mixed precision included.

Options (`solver_options`):

| option | default | meaning |
| --- | --- | --- |
| `start` | `"gptq"` | the solver whose codes and grids training starts from |
| `start_options` | `{}` | that solver's options |
| `steps` | 100 | optimizer steps per block |
| `batch_size` | 4 | calibration windows per step |
| `lr` | 0.01 | step size of the rounding offsets and zero points, in grid steps |
| `scale_lr` | 0.002 | step size of the scales, as a ratio to the start |
| `optimizer` | `"adam"` | `"adam"`, or `"signsgd"` (AutoRound's signed gradient descent) |
| `target` | `"float_model"` | what the block's output must match (below) |
| `loss` | `"relative"` | each token's squared error relative to its target's mean square, or plain `"mse"` |
| `max_offset` | 0.5 | bound of a weight's rounding offset in grid steps; `null`: unbounded (Block-AP) |
| `learn_scales` | true | also train each group's scale (clipping) and zero point |
| `seed` | 0 | the order of the mini-batches |

`target`: `"float_model"`, the float model's own hidden states (AutoRound, OmniQuant), so each block
also corrects the error its quantized inputs carry from earlier blocks; or `"float_block"`, the float
block on the quantized model's inputs (what GPTQ matches, layer by layer).
"""

import dataclasses
from typing import Any

import torch

from quantlab.errors import ConfigError
from quantlab.formats.codec import Codec
from quantlab.formats.layout import StorageLayout
from quantlab.solvers.base import InputStats, Solution, Solver

OPTIMIZERS = ("signsgd", "adam")
TARGETS = ("float_model", "float_block")
LOSSES = ("relative", "mse")


@dataclasses.dataclass(frozen=True)
class ReconstructOptions:
    start: str = "gptq"
    start_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    steps: int = 100
    batch_size: int = 4
    lr: float = 0.01
    scale_lr: float = 0.002
    optimizer: str = "adam"
    target: str = "float_model"
    loss: str = "relative"
    max_offset: float | None = 0.5
    learn_scales: bool = True
    seed: int = 0

    @classmethod
    def parse(cls, options: dict[str, Any] | None) -> "ReconstructOptions":
        """Validated options; a `ConfigError` names the bad one and what it takes."""
        options = dict(options or {})
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(f"reconstruct solver: unknown option(s) {unknown}; valid: {sorted(known)}")
        if options.get("start_options") is None:
            options.pop("start_options", None)
        parsed = cls(**options)
        parsed._check()
        return parsed

    def _check(self) -> None:
        from quantlab.solvers.registry import get_solver

        if not isinstance(self.start, str) or self.start == ReconstructSolver.name:
            raise ConfigError(f"reconstruct solver: start={self.start!r} must name another solver, e.g. 'gptq'")
        if get_solver(self.start).refines_blocks:
            raise ConfigError(f"reconstruct solver: start={self.start!r} must be a per-layer solver (rtn, mse, gptq)")
        if not isinstance(self.start_options, dict):
            raise ConfigError(f"reconstruct solver: start_options={self.start_options!r} must be a JSON object")
        for name, low in (("steps", 0), ("batch_size", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"reconstruct solver: {name}={value!r} must be a whole number >= {low}")
        for name in ("lr", "scale_lr", "max_offset"):
            value = getattr(self, name)
            if (value is not None or name != "max_offset") and (
                isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
            ):
                tail = ", or null" if name == "max_offset" else ""
                raise ConfigError(f"reconstruct solver: {name}={value!r} must be a number > 0{tail}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"reconstruct solver: optimizer={self.optimizer!r} must be one of {list(OPTIMIZERS)}")
        if self.target not in TARGETS:
            raise ConfigError(f"reconstruct solver: target={self.target!r} must be one of {list(TARGETS)}")
        if self.loss not in LOSSES:
            raise ConfigError(f"reconstruct solver: loss={self.loss!r} must be one of {list(LOSSES)}")
        if not isinstance(self.learn_scales, bool):
            raise ConfigError(f"reconstruct solver: learn_scales={self.learn_scales!r} must be true or false")


class ReconstructSolver(Solver):
    name = "reconstruct"
    needs_calibration = True
    refines_blocks = True
    description = "block-wise reconstruction: a start solver (gptq), then rounding and grids tuned on block outputs"

    def check_options(self, options: dict[str, Any]) -> None:
        ReconstructOptions.parse(options)

    def unsupported(self, layout: StorageLayout) -> str | None:
        if type(layout.codec_object).encode is Codec.encode:
            return f"codec {layout.codec!r} has no per-group grid to train (encode/decode)"
        return None

    def solve(
        self, weight: torch.Tensor, layout: StorageLayout, stats: InputStats | None, options: dict[str, Any]
    ) -> Solution:
        """The start solver's solution; the block-level training runs in the calibration schedule."""
        from quantlab.solvers.registry import get_solver

        parsed = ReconstructOptions.parse(options)
        return get_solver(parsed.start).solve(weight, layout, stats, dict(parsed.start_options))


SOLVER = ReconstructSolver()
