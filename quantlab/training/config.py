"""`TrainingConfig`: every option of the shared training loop, checked once, in one place.

The loop counts in optimizer steps: `max_steps` updates, each made of `grad_accum`
micro-batches of `batch_size` examples per process. Warmup, evaluation, logging and
checkpoints are all given in those steps.
"""

import dataclasses
import math
from pathlib import Path
from typing import Any

from quantlab.errors import ConfigError
from quantlab.training.optimizers import check_optimizer_name

PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
ACCELERATE_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


@dataclasses.dataclass
class TrainingConfig:
    """Options of `quantlab.training.Trainer`.

    Checkpoints go to `output_dir/checkpoints/step-NNNNNNNN` every `save_every` steps (and at
    the end); the last `keep_last` are kept. `resume_from` is a checkpoint folder, a run folder
    (its latest checkpoint is taken) or `"latest"` (the latest checkpoint of `output_dir`).
    `profile_steps=(start, stop)` records a `torch.profiler` trace of steps `start..stop-1`.
    """

    output_dir: str | Path
    max_steps: int
    batch_size: int = 4
    grad_accum: int = 1
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    optim: str = "adamw_torch"
    optim_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    lr_scheduler: str = "linear"
    scheduler_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    max_grad_norm: float | None = 1.0
    precision: str = "fp32"
    activation_checkpointing: bool = False
    compile: bool = False
    empty_cache_every: int = 0
    profile_steps: tuple[int, int] | None = None
    eval_every: int = 0
    log_every: int = 1
    save_every: int = 0
    keep_last: int = 2
    resume_from: str | Path | None = None
    seed: int = 0
    progress_bar: bool = True
    tensorboard: bool = True

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        if self.profile_steps is not None:
            self.profile_steps = tuple(self.profile_steps)  # type: ignore[assignment]
        self.validate()

    def validate(self) -> None:
        _positive("max_steps", self.max_steps)
        _positive("batch_size", self.batch_size)
        _positive("grad_accum", self.grad_accum)
        _positive("keep_last", self.keep_last)
        _positive("log_every", self.log_every)
        for name in ("warmup_steps", "eval_every", "save_every", "empty_cache_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a whole number >= 0 (0 turns it off)")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio={self.warmup_ratio!r} must lie in [0, 1)")
        if self.warmup_steps and self.warmup_ratio:
            raise ConfigError("give warmup_steps or warmup_ratio, not both")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate={self.learning_rate!r} must be > 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm={self.max_grad_norm!r} must be > 0, or None to turn clipping off")
        check_optimizer_name(self.optim)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is not valid; choose one of {', '.join(PRECISIONS)}")
        if self.lr_scheduler not in SCHEDULES:
            raise ConfigError(f"lr_scheduler={self.lr_scheduler!r} is not valid; choose one of {', '.join(SCHEDULES)}")
        if self.profile_steps is not None:
            start, stop = self.profile_steps
            if not 0 <= start < stop:
                raise ConfigError(f"profile_steps={self.profile_steps!r} must be (start, stop) with 0 <= start < stop")

    @property
    def num_warmup_steps(self) -> int:
        return self.warmup_steps or math.ceil(self.warmup_ratio * self.max_steps)

    @property
    def mixed_precision(self) -> str:
        """The name accelerate uses for `precision`."""
        return ACCELERATE_PRECISION[self.precision]


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a whole number >= 1")
