"""The run's log as JSON lines (`output_dir/log.jsonl`), one record per logging step or evaluation.

transformers' own log lives in `trainer_state.json` and goes to TensorBoard with
`report_to="tensorboard"`; this file is the one a script or the CLI report reads, with the
process's peak memory added to each record. On a resume, records after the resumed step are
dropped first, so the log of a resumed run reads as that of an uninterrupted one.
"""

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from quantlab.utils.atomic import atomic_file

LOG_FILE = "log.jsonl"
MIB = 1 << 20


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak memory of the process so far: the caching allocator's on CUDA, resident memory (`ru_maxrss`) otherwise."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


class RunLog(TrainerCallback):
    """Appends every `on_log` record of the main process to `output_dir/log.jsonl`."""

    def __init__(self, output_dir: Path) -> None:
        self.path = Path(output_dir) / LOG_FILE

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if state.is_world_process_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = [r for r in read_log(self.path.parent) if r["step"] <= state.global_step]
            with atomic_file(self.path) as staging:
                staging.write_text("".join(json.dumps(record) + "\n" for record in kept))

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        if state.is_world_process_zero and logs:
            record = {"step": state.global_step, **logs, "peak_memory_mib": peak_memory_bytes(args.device) / MIB}
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")


def read_log(output_dir: Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / LOG_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
