"""The flags `quantlab finetune`, `prune`, `distill` and `qat` share, declared once, named after `TrainingArguments`.

Every training command calls `add_training_flags(parser)` and gets the same flags,
with the same help and defaults: `--learning-rate`, `--max-steps`, `--per-device-train-batch-size`
(short: `--batch-size`), `--output-dir`, `--resume-from-checkpoint [latest|DIR]`, ... Any other
field passes through with `--training-arg name=value` or `--training-args FILE` (JSON or YAML);
values are typed and checked as `TrainingArguments` types them (`quantlab.training.arguments`).
Where a value is: the table's default < the command's default (`COMMAND_DEFAULTS`) <
`--training-args FILE` < `--training-arg` < the dedicated flag.

- `--output-dir DIR` is the run folder in every command: `trainer_state.json` (the log), `checkpoint-N`, the
  report, and the command's result in `DIR/final` (finetune: the adapter; prune and distill: the model).
- `--resume-from-checkpoint` (bare or `latest`) continues from the newest checkpoint of
  `--output-dir`; with a folder, from that checkpoint or that run folder's newest.
- `--max-seq-length` is the length of a training example; `--eval-seq-len` x `--eval-windows`
  are the evaluation windows.
"""

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from quantlab.cli.options import finite_float
from quantlab.errors import QuantlabError
from quantlab.workflows.runs import RUN_OPTIONS, TrainingRun

TRAINING_COMMANDS = ("finetune", "prune", "distill", "qat")
SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")

# Defaults that differ by command: LoRA (finetune) wants a larger learning rate than full-weight recovery.
COMMAND_DEFAULTS: dict[str, dict[str, Any]] = {
    "finetune": {"learning_rate": 2e-4, "lr_scheduler_type": "linear", "warmup_steps": 0,
                 "activation_checkpointing": True, "eval_windows": 4},
    "prune": {"learning_rate": 5e-5, "lr_scheduler_type": "cosine", "warmup_steps": 0.05,
              "activation_checkpointing": False, "eval_windows": 16, "max_steps": 0},
    "distill": {"learning_rate": 1e-4, "lr_scheduler_type": "cosine", "warmup_steps": 0.05,
                "activation_checkpointing": False, "eval_windows": 16},
    "qat": {"learning_rate": 5e-3, "lr_scheduler_type": "cosine", "warmup_steps": 0.05,
            "activation_checkpointing": False, "eval_windows": 16},
}  # fmt: skip
# quantlab's own run options; they are not TrainingArguments fields.
CLI_ONLY = RUN_OPTIONS


@dataclasses.dataclass(frozen=True)
class TrainingFlag:
    """One shared flag: `name` is its `TrainingArguments` field (or quantlab's name) and its argparse dest."""

    name: str
    help: str
    group: str = "training"
    type: Callable[[str], Any] | None = None
    default: Any = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()
    kind: str = "value"  # "value", "switch" (store_true), "toggle" (--x/--no-x), "optional" (nargs='?')
    shown_default: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def default_text(self) -> str:
        def shown(value: Any) -> str:
            if isinstance(value, bool):
                return "on" if value else "off"
            return f"{value:g}" if isinstance(value, float) else str(value)

        defaults = [f"{shown(d[self.name])} {c}" for c, d in COMMAND_DEFAULTS.items() if self.name in d]
        if self.shown_default is not None or defaults:
            return self.shown_default or ", ".join(defaults)
        return "off" if self.default in (None, False, 0) and self.kind != "value" else str(self.default)


def _steps_or_fraction(text: str) -> int | float:
    number = finite_float(text)
    return int(number) if number.is_integer() else number


def training_flags() -> list[TrainingFlag]:
    """The shared flags, in the order `--help` lists them."""
    return [
        TrainingFlag("output_dir", "run folder: log, checkpoint-N/, report, and the result in DIR/final",
                     metavar="DIR", aliases=("-o",), shown_default="required"),
        TrainingFlag("overwrite", "delete an existing DIR and start a new run in it", kind="switch"),
        TrainingFlag("max_steps", "optimizer steps (prune: recovery steps after pruning, 0 for none)",
                     type=int, metavar="N", shown_default="required by finetune and distill, 0 prune"),
        TrainingFlag("learning_rate", "peak learning rate", type=finite_float, metavar="LR"),
        TrainingFlag("per_device_train_batch_size", "examples per micro-batch and process", type=int, default=4,
                     metavar="N", aliases=("--batch-size",)),
        TrainingFlag("gradient_accumulation_steps", "micro-batches per optimizer step", type=int, default=1,
                     metavar="K"),
        TrainingFlag("max_seq_length", "tokens per training example", type=int, default=256, metavar="N"),
        TrainingFlag("lr_scheduler_type", "learning-rate schedule", choices=SCHEDULES),
        TrainingFlag("warmup_steps", "warmup steps, or a fraction in [0, 1) of --max-steps", type=_steps_or_fraction,
                     metavar="N|F"),
        TrainingFlag("weight_decay", "AdamW weight decay", type=finite_float, default=0.0, metavar="F"),
        TrainingFlag("max_grad_norm", "gradient clipping norm, 0 turns it off", type=finite_float, default=1.0,
                     metavar="F"),
        TrainingFlag("optim", "optimizer, by TrainingArguments name (adamw_torch, adamw_8bit, paged_adamw_8bit, "
                     "lion_8bit, adafactor, ...)", default="adamw_torch", metavar="NAME"),
        TrainingFlag("bf16", "bfloat16 mixed precision", kind="switch"),
        TrainingFlag("fp16", "float16 mixed precision", kind="switch"),
        TrainingFlag("activation_checkpointing", "recompute activations in the backward pass", kind="toggle"),
        TrainingFlag("torch_compile", "torch.compile the model", kind="switch"),
        TrainingFlag("torch_empty_cache_steps", "empty the allocator cache every N steps", type=int, metavar="N",
                     shown_default="off"),
        TrainingFlag("seed", "seed of the run", type=int, default=0, metavar="N"),
        TrainingFlag("data", "training text, .txt or .jsonl", metavar="FILE",
                     shown_default="the bundled WikiText-2 text after its held-out windows"),
        TrainingFlag("text_field", "JSONL field holding the text", default="text", metavar="NAME"),
        TrainingFlag("save_steps", "checkpoint every N steps, 0 off", "checkpoints", type=int, default=0,
                     metavar="N"),
        TrainingFlag("save_total_limit", "checkpoints kept", "checkpoints", type=int, default=2, metavar="K"),
        TrainingFlag("resume_from_checkpoint", "continue from the newest checkpoint of --output-dir (latest), "
                     "or of DIR", "checkpoints", metavar="latest|DIR", kind="optional", shown_default="a new run"),
        TrainingFlag("logging_steps", "log every N steps", "logging and evaluation", type=int, default=1,
                     metavar="N"),
        TrainingFlag("eval_steps", "held-out perplexity every N steps, into the log; 0 off",
                     "logging and evaluation", type=int, default=0, metavar="N"),
        TrainingFlag("eval_windows", "held-out evaluation windows", "logging and evaluation", type=int,
                     metavar="N"),
        TrainingFlag("eval_seq_len", "tokens per evaluation window", "logging and evaluation", type=int,
                     default=512, metavar="N"),
    ]  # fmt: skip


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The shared training flags, identical in every training command; no abbreviations (one spelling each)."""
    parser.allow_abbrev = False
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in training_flags():
        group = groups.get(spec.group) or groups.setdefault(spec.group, parser.add_argument_group(spec.group))
        text = f"{spec.help} (default: {spec.default_text()})"
        names = (spec.flag, *spec.aliases)
        if spec.kind == "switch":
            group.add_argument(*names, dest=spec.name, action="store_true", default=None, help=text)
        elif spec.kind == "toggle":
            group.add_argument(*names, dest=spec.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif spec.kind == "optional":
            group.add_argument(*names, dest=spec.name, nargs="?", const="latest", metavar=spec.metavar, help=text)
        else:
            group.add_argument(*names, dest=spec.name, type=spec.type, choices=spec.choices, metavar=spec.metavar,
                               help=text)  # fmt: skip
    passthrough = groups["training"]
    passthrough.add_argument(
        "--training-arg", action="append", default=[], metavar="NAME=VALUE", dest="training_arg",
        help="any other TrainingArguments field, e.g. --training-arg lr_scheduler_kwargs='{\"power\": 2}' (repeatable)",
    )  # fmt: skip
    passthrough.add_argument(
        "--training-args", metavar="FILE", dest="training_args_file",
        help="TrainingArguments fields from a JSON or YAML file; flags given on the command line win",
    )  # fmt: skip


# -- from flags to a run ---------------------------------------------------------------------------


def resolve_training_flags(args: argparse.Namespace, command: str) -> TrainingRun:
    """The run the flags describe: defaults, command defaults, file, `--training-arg`, then the flags given.

    Sets each value on `args` too. Bad values are refused here, before any model is loaded;
    `--max-steps` is required but by prune.
    """
    from transformers.hf_argparser import string_to_bool

    from quantlab.training.arguments import convert_value, read_training_arguments_file

    values: dict[str, Any] = {spec.name: spec.default for spec in training_flags()}
    values.update(COMMAND_DEFAULTS[command])
    chosen: dict[str, Any] = {}
    if args.training_args_file:
        chosen.update(read_training_arguments_file(args.training_args_file))
    for item in args.training_arg:
        name, equals, text = item.partition("=")
        if not equals or not name.strip():
            raise QuantlabError(f"--training-arg {item!r}: write NAME=VALUE, e.g. --training-arg weight_decay=0.01")
        chosen[name.strip().replace("-", "_")] = text
    specs = {spec.name: spec for spec in training_flags()}
    for spec in specs.values():
        if getattr(args, spec.name, None) is not None:
            chosen[spec.name] = getattr(args, spec.name)
    for name, value in chosen.items():  # unknown names and bad values fail now, before any model is loaded
        if name not in CLI_ONLY and value is not None:
            chosen[name] = convert_value(name, value)
        elif isinstance(value, str):  # a CLI value passed through by name: typed as its flag types it
            convert = string_to_bool if specs[name].kind == "switch" else specs[name].type or str
            try:
                chosen[name] = convert(value)
            except (ValueError, argparse.ArgumentTypeError) as error:
                raise QuantlabError(f"training argument {name}={value!r}: {error}") from error
    values.update(chosen)
    run = TrainingRun.from_values(values)
    if values.get("bf16") and values.get("fp16"):
        raise QuantlabError("--bf16 and --fp16 both given; choose one")
    for name, value in values.items():
        setattr(args, name, value)
    run.validate(steps_required=command != "prune")
    return run


def print_report(console: Any, title: str, rows: list[tuple[str, str]], report: dict[str, Any]) -> None:
    """A training command's report as a table (or one JSON line with --json) on stdout."""
    from quantlab.cli.console import key_value_table

    console.report(key_value_table(title, rows), report)
