"""The training log: a progress bar on the console, `log.jsonl` in the run folder, TensorBoard if installed.

Only the main process writes. Each record is one JSON object per line (step, loss, learning
rate, gradient norm, tokens/s, memory, optimizer-state bytes, evaluation results), flushed as
it is written, so a crashed run keeps its log up to its last step. A resumed run first drops
the records past the checkpoint it resumes from, so the log reads as one uninterrupted run.
"""

import json
import logging
import math
from pathlib import Path
from typing import Any

from quantlab.utils.atomic import atomic_file

LOG_FILE = "log.jsonl"
logger = logging.getLogger("quantlab.training")


class RunLog:
    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        first_step: int,
        enabled: bool,
        progress_bar: bool = True,
        tensorboard: bool = True,
    ) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / LOG_FILE
        self.bar = None
        self.writer = None
        self._handle = None
        if not enabled:
            return
        _truncate_after(self.path, first_step)
        self._handle = self.path.open("a", encoding="utf-8")
        if progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=first_step, desc="training", unit="step", dynamic_ncols=True)
        if tensorboard:
            self.writer = _tensorboard_writer(Path(output_dir) / "tensorboard", first_step)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._handle.write(json.dumps(record, sort_keys=True) + "\n")
        self._handle.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    tag = key if key.startswith("eval_") else f"train/{key}"
                    self.writer.add_scalar(tag, value, record["step"])
        if self.bar is None:
            logger.info(" ".join(f"{k}={_short(v)}" for k, v in record.items()))

    def advance(self, step: int, postfix: dict[str, Any] | None = None) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if postfix:
                self.bar.set_postfix({k: _short(v) for k, v in postfix.items()}, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self._handle is not None:
            self._handle.close()
        self.bar = self.writer = self._handle = None


def read_log(output_dir: Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / LOG_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _truncate_after(path: Path, step: int) -> None:
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    with atomic_file(path) as staging:
        staging.write_text("".join(line + "\n" for line in kept))


def _tensorboard_writer(folder: Path, first_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # optional: the JSONL log has everything
        logger.debug("tensorboard is not installed; logging to log.jsonl only")
        return None
    return SummaryWriter(log_dir=str(folder), purge_step=first_step or None)


def _short(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.4g}"
    return value
