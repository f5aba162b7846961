"""A training workflow's run: its folder, its data, and the `TrainingArguments` it trains with.

`output_dir` is the run folder of every training workflow: `trainer_state.json` (the log),
`checkpoint-N`, the report, and the result in `output_dir/final` (finetune: the adapter; prune
and distill: the model). `arguments` holds `TrainingArguments` fields (`max_steps`,
`learning_rate`, `resume_from_checkpoint`, ...); the other fields are quantlab's own: the
length of a training example, the held-out evaluation windows kept out of the training text,
and the training text itself (None: the bundled WikiText-2 text after those windows).
"""

import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantlab.errors import QuantlabError

# quantlab's own run options; every other name of a flat mapping of values is a TrainingArguments field.
RUN_OPTIONS = ("max_seq_length", "eval_windows", "eval_seq_len", "data", "text_field", "overwrite")


class TrainingRunError(QuantlabError, ValueError):
    """A run option with a value no run can use, or a run folder that cannot be used."""


@dataclass(frozen=True)
class TrainingRun:
    """Where a training workflow writes, on what it trains, and its `TrainingArguments` fields."""

    output_dir: Path
    arguments: Mapping[str, Any] = field(default_factory=dict)
    max_seq_length: int = 256
    eval_windows: int = 4
    eval_seq_len: int = 512
    data: Path | None = None
    text_field: str = "text"
    overwrite: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_dir", Path(self.output_dir).expanduser())
        if self.data is not None:
            object.__setattr__(self, "data", Path(self.data).expanduser())

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> "TrainingRun":
        """A run from one flat mapping: `output_dir`, quantlab's run options by name, and TrainingArguments fields."""
        if values.get("output_dir") is None:
            raise TrainingRunError(
                "--output-dir DIR is required: the run folder (log, checkpoints, the result in DIR/final)"
            )
        options = {name: values[name] for name in RUN_OPTIONS if values.get(name) is not None}
        arguments = {
            name: value
            for name, value in values.items()
            if name not in RUN_OPTIONS and name != "output_dir" and value is not None
        }
        return cls(Path(values["output_dir"]), arguments, **options)

    @property
    def max_steps(self) -> int:
        return int(self.arguments.get("max_steps") or 0)

    @property
    def eval_steps(self) -> int:
        return int(self.arguments.get("eval_steps") or 0)

    @property
    def seed(self) -> int:
        return int(self.arguments.get("seed") or 0)

    @property
    def resume_from_checkpoint(self) -> str | None:
        return self.arguments.get("resume_from_checkpoint")

    def validate(self, steps_required: bool = True) -> None:
        """Refuse values no run can use, before any model is loaded; `steps_required`: `max_steps` must be >= 1."""
        max_steps = self.arguments.get("max_steps")
        if max_steps is None and steps_required:
            raise TrainingRunError("--max-steps N is required: the number of optimizer steps")
        if max_steps is not None and max_steps < (1 if steps_required else 0):
            raise TrainingRunError(f"--max-steps must be at least {1 if steps_required else 0}")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            if self.arguments.get(name, 1) < 1:
                raise TrainingRunError(f"--{name.replace('_', '-')} must be at least 1")
        if self.eval_seq_len < 1:
            raise TrainingRunError("--eval-seq-len must be at least 1")
        if self.max_seq_length < 2:
            raise TrainingRunError("--max-seq-length must be at least 2")
        if self.eval_windows < 0:
            raise TrainingRunError("--eval-windows must be 0 (no evaluation) or more")
        if self.data is not None and not self.data.is_file():
            raise TrainingRunError(f"--data {self.data}: no such file")

    def prepare(self, inputs: Iterable[Path]) -> Path:
        """The run folder: continued when resuming, replaced with `overwrite`, else new; returns it.

        The folder may not be, contain or lie inside `inputs` (the models read) or the `data` file.
        """
        from quantlab.utils.atomic import OutputExistsError, check_not_input, check_replaceable, make_staging

        output = self.output_dir
        protected = [*inputs, *([self.data] if self.data else [])]
        check_not_input(output, protected)
        if output.exists() and not output.is_dir():
            raise TrainingRunError(
                f"--output-dir {output} is a file; the run needs a folder there, so pick a folder path"
            )
        if self.resume_from_checkpoint or not output.exists():
            return output
        if not self.overwrite:
            raise OutputExistsError(
                f"output {output} already exists; pass --resume-from-checkpoint to continue its run, --overwrite to "
                f"replace it, or pick another"
            )
        check_replaceable(output, overwrite=True, protect=protected)
        if os.environ.get("RANK", "0") == "0":
            retired = make_staging(output.parent, output.name, "old")
            os.replace(output, retired / output.name)
            shutil.rmtree(retired, ignore_errors=True)
        return output

    def documents(self) -> list[str] | None:
        """The training text's documents, or None for the bundled text."""
        from quantlab.training import read_documents

        return read_documents(self.data, text_field=self.text_field) if self.data else None

    def training_data(self, tokenizer: Any) -> Any:
        """Training examples, and the held-out windows (`eval_windows` x `eval_seq_len`) kept out of them."""
        from quantlab.training import causal_lm_data

        if tokenizer is None:
            raise TrainingRunError("training needs the model's tokenizer, and the model folder has none")
        return causal_lm_data(tokenizer, self.documents(), self.max_seq_length, self.eval_windows, self.eval_seq_len)

    def training_arguments(self, progress: bool = False, **fixed: Any) -> Any:
        """`TrainingArguments` of the run; `fixed` (what the workflow decides) wins over `arguments`."""
        from quantlab.training.arguments import training_arguments as build

        given = {name: value for name, value in self.arguments.items() if value is not None}
        return build({**given, "output_dir": str(self.output_dir), "disable_tqdm": not progress}, **fixed)
