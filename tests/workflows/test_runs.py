"""`TrainingRun`: one flat mapping split into run options and TrainingArguments fields, checked before any work."""

from pathlib import Path

import pytest

from quantlab.utils.atomic import OutputExistsError, UnsafeOutputError
from quantlab.workflows.runs import TrainingRun, TrainingRunError


def test_from_values_splits_run_options_from_training_arguments(tmp_path: Path) -> None:
    run = TrainingRun.from_values(
        {"output_dir": str(tmp_path / "run"), "max_steps": 3, "learning_rate": 1e-3, "seed": None, "eval_windows": 2}
    )
    assert run.output_dir == tmp_path / "run"
    assert dict(run.arguments) == {"max_steps": 3, "learning_rate": 1e-3}  # None: TrainingArguments' default
    assert (run.eval_windows, run.max_steps, run.seed, run.resume_from_checkpoint) == (2, 3, 0, None)
    arguments = run.training_arguments(eval_steps=0)
    assert (arguments.max_steps, arguments.learning_rate, arguments.output_dir) == (3, 1e-3, str(tmp_path / "run"))


def test_from_values_needs_a_run_folder() -> None:
    with pytest.raises(TrainingRunError, match="--output-dir DIR is required"):
        TrainingRun.from_values({"max_steps": 1})


@pytest.mark.parametrize(
    ("arguments", "options", "steps_required", "message"),
    [
        ({}, {}, True, "--max-steps N is required"),
        ({"max_steps": 0}, {}, True, "--max-steps must be at least 1"),
        ({"max_steps": -1}, {}, False, "--max-steps must be at least 0"),
        ({"max_steps": 1, "per_device_train_batch_size": 0}, {}, True, "--per-device-train-batch-size must be"),
        ({"max_steps": 1}, {"max_seq_length": 1}, True, "--max-seq-length must be at least 2"),
        ({"max_steps": 1}, {"eval_windows": -1}, True, "--eval-windows must be 0"),
        ({"max_steps": 1}, {"eval_seq_len": 0}, True, "--eval-seq-len must be at least 1"),
        ({"max_steps": 1}, {"data": "no-such.txt"}, True, "no-such.txt: no such file"),
    ],
)
def test_validate_refuses_values_no_run_can_use(tmp_path, arguments, options, steps_required, message) -> None:
    with pytest.raises(TrainingRunError, match=message):
        TrainingRun(tmp_path / "run", arguments, **options).validate(steps_required)


def test_prepare_keeps_an_existing_run_unless_told(tmp_path: Path) -> None:
    model, output = tmp_path / "model", tmp_path / "run"
    model.mkdir()
    output.mkdir()
    (output / "old.txt").write_text("previous run")
    with pytest.raises(OutputExistsError, match="pass --resume-from-checkpoint to continue its run"):
        TrainingRun(output, {"max_steps": 1}).prepare([model])
    assert TrainingRun(output, {"max_steps": 1, "resume_from_checkpoint": "latest"}).prepare([model]) == output
    assert (output / "old.txt").is_file()  # resuming continues the run in place
    assert TrainingRun(output, {"max_steps": 1}, overwrite=True).prepare([model]) == output
    assert not output.exists() and model.is_dir()  # replaced: the new run starts empty; the input stays


def test_prepare_refuses_an_input_as_the_run_folder(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(UnsafeOutputError, match="is the input"):
        TrainingRun(model, {"max_steps": 1}, overwrite=True).prepare([model])
    with pytest.raises(UnsafeOutputError, match="lies inside the input folder"):
        TrainingRun(model / "run", {"max_steps": 1}).prepare([model])
    assert model.is_dir() and list(model.iterdir()) == []
