"""The training commands' one vocabulary: identical shared flags, old spellings refused, `--training-arg`."""

import argparse
import dataclasses
import json

import pytest
from transformers import TrainingArguments

from quantlab.cli.main import build_parser, main, parse
from quantlab.cli.training_flags import CLI_ONLY, TRAINING_COMMANDS, resolve_training_flags, training_flags

BASE = {
    "finetune": ["finetune"],
    "prune": ["prune", "--pattern", "2:4"],
    "distill": ["distill", "--teacher", "t", "--student", "s"],
    "qat": ["qat", "q"],
}
SHARED_DESTS = {spec.name for spec in training_flags()} | {"training_arg", "training_args_file"}
TRAINING_ARGUMENTS_FLAGS = [
    "--learning-rate", "--max-steps", "--per-device-train-batch-size", "--gradient-accumulation-steps",
    "--lr-scheduler-type", "--warmup-steps", "--save-steps", "--save-total-limit", "--logging-steps",
    "--eval-steps", "--bf16", "--fp16", "--optim", "--resume-from-checkpoint", "--output-dir",
    "--activation-checkpointing",
]  # fmt: skip


def _command_parser(command: str) -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("no subcommands")


def _shared_actions(command: str) -> dict[str, tuple]:
    """Every visible shared flag of `command`, with what a user sees and gets from it."""
    described = {}
    for action in _command_parser(command)._actions:
        if action.dest in SHARED_DESTS and action.help != argparse.SUPPRESS:
            described[action.option_strings[0]] = (
                tuple(action.option_strings), action.dest, action.default, action.help, action.type,
                tuple(action.choices) if action.choices else None, action.nargs, action.const, action.metavar,
                type(action).__name__,
            )  # fmt: skip
    return described


def test_shared_flags_are_identical_in_every_training_command():
    finetune = _shared_actions("finetune")
    assert finetune == _shared_actions("prune") == _shared_actions("distill")
    assert set(TRAINING_ARGUMENTS_FLAGS) <= set(finetune)
    assert len(finetune) == len(SHARED_DESTS)  # one visible flag per shared value
    assert "--batch-size" in finetune["--per-device-train-batch-size"][0]


def test_shared_flags_are_named_after_training_arguments_fields():
    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    for spec in training_flags():
        assert spec.name in fields or spec.name in CLI_ONLY, spec.name
        assert spec.flag == "--" + spec.name.replace("_", "-")


def test_no_visible_flag_is_spelled_two_ways():
    for command in TRAINING_COMMANDS:
        visible = [a for a in _command_parser(command)._actions if a.help != argparse.SUPPRESS]
        dests = [a.dest for a in visible if a.dest in SHARED_DESTS and a.dest not in ("bf16", "fp16")]
        assert len(dests) == len(set(dests)), command


# Spellings that are not flags (abbreviations of the real flags included): each is refused.
OLD_SPELLINGS = [
    ("finetune", ["--lr", "0.1"]),
    ("finetune", ["--steps", "3"]),
    ("finetune", ["--resume"]),
    ("finetune", ["--precision", "bf16"]),
    ("prune", ["--finetune-steps", "2"]),
    ("prune", ["--run-dir", "r"]),
    ("distill", ["--output", "run"]),
    ("distill", ["--seq-len", "128"]),
]


@pytest.mark.parametrize(("command", "old"), OLD_SPELLINGS, ids=lambda x: str(x))
def test_old_spellings_are_refused_in_one_line_exit_2(command, old, tmp_path, capsys):
    assert main([*BASE[command], "-o", str(tmp_path / "x"), *old]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "unrecognized arguments" in error[0] and old[0] in error[0], error


def _config(command: str, *extra: str) -> TrainingArguments:
    args = parse([*BASE[command], "-o", "run", "--max-steps", "5", *extra])
    return resolve_training_flags(args, command).training_arguments(progress=False)


def test_training_arg_passes_fields_through_and_flags_win(tmp_path):
    config = _config(
        "distill",
        "--training-arg", "weight_decay=0.01",
        "--training-arg", 'lr_scheduler_kwargs={"power": 2.0}',
        "--training-arg", "max_grad_norm=0",
        "--training-arg", "learning_rate=1e-2",
        "--learning-rate", "3e-3",
        "--training-arg", "bf16=true",
        "--training-arg", "neftune_noise_alpha=5",
    )  # fmt: skip
    assert config.weight_decay == 0.01 and config.lr_scheduler_kwargs == {"power": 2.0}
    assert config.max_grad_norm == 0  # TrainingArguments' 0 = no clipping
    assert config.learning_rate == 3e-3  # the dedicated flag wins over --training-arg
    assert config.bf16 and config.neftune_noise_alpha == 5  # any TrainingArguments field passes through


def test_training_arg_sets_the_cli_values_too_typed():
    args = parse(
        [*BASE["prune"], "-o", "run", "--training-arg", "max_seq_length=64", "--training-arg", "eval_windows=3"]
    )
    resolve_training_flags(args, "prune")
    assert (args.max_seq_length, args.eval_windows) == (64, 3)


def test_command_defaults_and_warmup_in_steps():
    prune, finetune = _config("prune"), _config("finetune")
    assert (prune.learning_rate, prune.lr_scheduler_type, prune.warmup_steps) == (5e-5, "cosine", 0.05)
    assert finetune.learning_rate == 2e-4
    assert _config("prune", "--warmup-steps", "3").warmup_steps == 3  # steps replace the command's default ratio


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_training_args_file_json_or_yaml(suffix, tmp_path):
    path = tmp_path / f"args{suffix}"
    values = {"gradient_accumulation_steps": 3, "optim": "adafactor", "warmup_steps": 0.1}
    text = json.dumps(values) if suffix == ".json" else "\n".join(f"{k}: {v}" for k, v in values.items())
    path.write_text(text)
    config = _config("finetune", "--training-args", str(path), "--training-arg", "gradient_accumulation_steps=2")
    assert (config.gradient_accumulation_steps, config.optim, config.warmup_steps) == (2, "adafactor", 0.1)


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        ("learning_rat=1e-3", "unknown training argument 'learning_rat'; did you mean learning_rate"),
        ("warmup_steps=abc", "training argument warmup_steps='abc'"),
        ("no_equals_sign", "write NAME=VALUE"),
        ("lr_scheduler_type=steep", "training argument lr_scheduler_type='steep'"),
    ],
)
@pytest.mark.parametrize("command", TRAINING_COMMANDS)
def test_bad_training_arg_is_one_line_exit_2_before_any_work(command, item, fragment, tmp_path, capsys):
    output = tmp_path / "run"
    assert main([*BASE[command], "-o", str(output), "--training-arg", item]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("quantlab: error:") and fragment in error[0], error
    assert not output.exists()


def test_output_dir_is_required(capsys):
    assert main(BASE["finetune"]) == 2
    assert "--output-dir DIR is required" in capsys.readouterr().err
