"""A run's log as lines on stderr when no progress bar shows it (a run in the background, under a scheduler, in CI).

transformers prints each log record to stdout as a dict (`PrinterCallback`) when its progress bar is off;
quantlab keeps stdout for the caller's report and writes one line per record to stderr instead:
`step 10/300: loss 0.3186, grad_norm 1.02, learning_rate 0.004972, epoch 0.02`. The lines follow
transformers' logging: `transformers.logging.set_verbosity_error()` (what `--quiet` and `--json` do)
silences them.
"""

import logging
import sys
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from transformers.utils import logging as hf_logging

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

_LEFT_OUT = ("total_flos",)  # a running total, not a figure of the step


def format_record(step: int, max_steps: int, record: dict[str, Any]) -> str:
    """`step N/M: name value, ...` with floats to 4 significant digits."""
    values = ", ".join(
        f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}"
        for name, value in record.items()
        if name not in _LEFT_OUT
    )
    return f"step {step}/{max_steps}: {values}"


class LogLines(TrainerCallback):
    """Writes each log record to stderr as one line while the progress bar is off (`disable_tqdm`)."""

    def on_log(
        self,
        args: "TrainingArguments",
        state: "TrainerState",
        control: "TrainerControl",
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not logs or not args.disable_tqdm or not state.is_world_process_zero:
            return
        if hf_logging.get_verbosity() >= logging.ERROR:
            return
        print(format_record(state.global_step, state.max_steps, logs), file=sys.stderr, flush=True)
