"""Callbacks: where pruning, distillation and other extensions plug into the shared loop.

The loop calls, in this order, for each optimizer step:
`on_step_begin` → (forward, loss, backward for each micro-batch) → `on_before_optimizer_step`
(gradients complete and synchronized, before clipping: mask gradients here) → optimizer and
scheduler step → `on_optimizer_step` (re-apply pruning masks here) → `on_log` →
`on_evaluate` (every `eval_every`) → `on_save` (every `save_every`).

A callback with state to keep across a resume (a pruning schedule's masks, say) returns it
from `state_dict` and takes it back in `load_state_dict`; the loop stores it in every
checkpoint. Losses are not callbacks: pass `loss=` to the `Trainer` (see `quantlab.training.loss`).
"""

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from quantlab.training.memory import release_cached_memory

if TYPE_CHECKING:
    from quantlab.training.trainer import Trainer


class Callback:
    """Hooks of the training loop; every method is optional."""

    def on_train_begin(self, trainer: "Trainer") -> None: ...

    def on_step_begin(self, trainer: "Trainer") -> None: ...

    def on_before_optimizer_step(self, trainer: "Trainer") -> None: ...

    def on_optimizer_step(self, trainer: "Trainer") -> None: ...

    def on_log(self, trainer: "Trainer", logs: dict[str, Any]) -> None: ...

    def on_evaluate(self, trainer: "Trainer", metrics: dict[str, float]) -> None: ...

    def on_save(self, trainer: "Trainer", checkpoint_dir: Path) -> None: ...

    def on_train_end(self, trainer: "Trainer") -> None: ...

    def state_dict(self) -> dict[str, Any] | None:
        """State saved in checkpoints; `None` (the default) saves nothing."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def settings(self) -> dict[str, Any] | None:
        """Options that change the trained result (a pruning schedule's), for the run's fingerprint.

        A resume with other settings is refused. `None` (the default): nothing to compare.
        """
        return None


class CallbackList:
    """Calls one hook on every callback, in the order given."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = list(callbacks)

    def call(self, hook: str, trainer: "Trainer", *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(trainer, *args)

    def stateful(self) -> list[Callback]:
        return [callback for callback in self.callbacks if callback.state_dict() is not None]


class EmptyCacheEvery(Callback):
    """Release cached allocator memory every `every` optimizer steps (see `memory.release_cached_memory`)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_optimizer_step(self, trainer: "Trainer") -> None:
        if trainer.state.step % self.every == 0:
            release_cached_memory()


class ProfilerWindow(Callback):
    """Record `torch.profiler` over optimizer steps `start..stop-1`.

    Writes a Chrome trace (open it in chrome://tracing or Perfetto) and a table of the
    operators by self time to `output_dir/profile/`, one pair per process.
    """

    def __init__(self, start: int, stop: int, output_dir: Path) -> None:
        self.start, self.stop = start, stop
        self.output_dir = Path(output_dir)
        self.profiler: torch.profiler.profile | None = None

    def on_step_begin(self, trainer: "Trainer") -> None:
        step = trainer.state.step  # optimizer steps done so far
        if self.profiler is None and self.start <= step < self.stop:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.accelerator.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profiler.__enter__()

    def on_optimizer_step(self, trainer: "Trainer") -> None:
        if self.profiler is not None and trainer.state.step >= self.stop:
            self._finish(trainer)

    def on_train_end(self, trainer: "Trainer") -> None:
        if self.profiler is not None:
            self._finish(trainer)

    def _finish(self, trainer: "Trainer") -> None:
        from quantlab.utils.atomic import atomic_file

        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        rank = trainer.accelerator.process_index
        with atomic_file(self.output_dir / f"trace-rank{rank}.json") as staging:
            profiler.export_chrome_trace(str(staging))
        with atomic_file(self.output_dir / f"summary-rank{rank}.txt") as staging:
            staging.write_text(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
