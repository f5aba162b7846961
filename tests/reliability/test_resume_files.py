"""Every file a resume reads, damaged, truncated, edited or replaced by a pickle payload: refused, never run.

A checkpoint holds no pickle (JSON + safetensors in place of transformers' pickled files)
and records the size and SHA-256 of each file in `manifest.json`. Each case edits one file the
way a truncated copy, a bit flip or a hostile sender would, with the recorded checksum left alone or forged to match,
and expects a `ResumeError` (exit 2 in the CLI) whose message names the fault; a planted
payload must never run. An intact copy resumes bit-identically.
"""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantlab.training import ResumeError

STATE_FILES = [
    "trainable.safetensors",
    "optimizer.json",
    "optimizer.safetensors",
    "scheduler.json",
    "scheduler.safetensors",
    "callbacks.json",
    "callbacks.safetensors",
    "random_states_0.json",
    "random_states_0.safetensors",
]


def test_the_checkpoint_holds_no_pickle(saved_run):
    names = {path.name for path in saved_run.checkpoint.iterdir()}
    assert names == {*STATE_FILES, "trainer_state.json", "manifest.json"}
    for name in names:  # each one is plain JSON or safetensors, formats that cannot carry code
        path = saved_run.checkpoint / name
        json.loads(path.read_text()) if name.endswith(".json") else load_file(str(path))


def test_an_intact_copy_resumes_bit_identically(run_copy):
    trainer = run_copy.resume()
    got = {n: p for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters() if p.requires_grad}
    assert got.keys() == run_copy.final.keys()
    assert all(torch.equal(got[name], run_copy.final[name]) for name in got)


# -- pickle payloads --------------------------------------------------------------------------


PAYLOAD_CASES = [
    *[("kept", name) for name in [*STATE_FILES, "trainer_state.json", "manifest.json"]],
    *[("forged", name) for name in [*STATE_FILES, "trainer_state.json"]],  # the manifest holds the checksums
]


@pytest.mark.parametrize(("checksum", "name"), PAYLOAD_CASES, ids=[f"{c}-{n}" for c, n in PAYLOAD_CASES])
def test_a_pickle_payload_in_place_of_a_state_file_never_runs(name, checksum, run_copy, pickle_bomb, forge):
    target = run_copy.checkpoint / name
    target.write_bytes(pickle_bomb.torch_file)
    if checksum == "forged":
        forge(run_copy.checkpoint, name)
    # With the manifest kept, the size check refuses the payload, or the checksum when the sizes happen to agree.
    kept = "bytes but was|does not match the checksum"
    expected = "cannot read" if checksum == "forged" or name == "manifest.json" else kept
    with pytest.raises(ResumeError, match=expected) as refused:
        run_copy.resume()
    assert name in str(refused.value)
    assert not pickle_bomb.ran()


PICKLE_NAMES = [
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
    "rng_state.pth",
    "rng_state_0.pth",
    "training_args.bin",
    "pytorch_model.bin",
    "adapter_model.bin",
    "custom_checkpoint_0.pkl",
    "random_states_0.pkl",
]  # fmt: skip  (what transformers' Trainer and accelerate's save_state write and read with torch.load)


@pytest.mark.parametrize("name", PICKLE_NAMES)
def test_pickle_files_of_transformers_and_accelerate_planted_beside_a_checkpoint_are_refused(
    name, run_copy, pickle_bomb
):
    (run_copy.checkpoint / name).write_bytes(pickle_bomb.torch_file)
    with pytest.raises(ResumeError, match=f"{name} was not written with this checkpoint"):
        run_copy.resume()
    assert not pickle_bomb.ran()


# -- damaged and edited files -----------------------------------------------------------------


def _truncate(name: str, keep: float = 0.5) -> Callable[[Path], None]:
    def edit(checkpoint: Path) -> None:
        data = (checkpoint / name).read_bytes()
        (checkpoint / name).write_bytes(data[: int(len(data) * keep)])

    return edit


def _flip_a_byte(name: str) -> Callable[[Path], None]:
    def edit(checkpoint: Path) -> None:
        data = bytearray((checkpoint / name).read_bytes())
        data[-1] ^= 0xFF
        (checkpoint / name).write_bytes(bytes(data))

    return edit


def _edit_tensors(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(checkpoint: Path) -> None:
        tensors = load_file(str(checkpoint / name))
        change(tensors)
        save_file(tensors, str(checkpoint / name))

    return edit


def _edit_json(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(checkpoint: Path) -> None:
        values = json.loads((checkpoint / name).read_text())
        change(values)
        (checkpoint / name).write_text(json.dumps(values))

    return edit


def _transpose_a_moment(tensors: dict) -> None:
    for key, tensor in tensors.items():
        if tensor.dim() == 2 and tensor.shape[0] != tensor.shape[1]:
            tensors[key] = tensor.t().contiguous()
            return


def _drop_a_parameter(values: dict) -> None:
    values["param_groups"][0]["params"].pop()


def _add_a_callback(values: list) -> None:
    values.append({"callback": "GradualPruning", "state": {}})


def _delete(name: str) -> Callable[[Path], None]:
    return lambda checkpoint: (checkpoint / name).unlink()


def _cut_torch_rng(checkpoint: Path) -> None:
    """The torch generator's state shortened to 100 bytes, in an otherwise valid file."""
    key = json.loads((checkpoint / "random_states_0.json").read_text())["torch"]["__tensor__"]
    _edit_tensors("random_states_0.safetensors", lambda t: t.update({key: t[key][:100].clone()}))(checkpoint)


# (case, edit, file whose checksum is forged afterwards or None, expected message)
DAMAGE = [
    ("RNG state truncated", _truncate("random_states_0.safetensors"), None, "bytes but was 10184"),
    (
        "RNG state JSON truncated, checksum forged",
        _truncate("random_states_0.json"),
        "random_states_0.json",
        "cannot read",
    ),
    (
        "torch RNG state cut short, checksum forged",
        _cut_torch_rng,
        "random_states_0.safetensors",
        "not hold a valid random-number state",
    ),
    ("optimizer moments flipped", _flip_a_byte("optimizer.safetensors"), None, "does not match the checksum"),
    (
        "optimizer moment transposed, checksum forged",
        _edit_tensors("optimizer.safetensors", _transpose_a_moment),
        "optimizer.safetensors",
        "has shape",
    ),
    (
        "optimizer parameter dropped, checksum forged",
        _edit_json("optimizer.json", _drop_a_parameter),
        "optimizer.json",
        "does not fit this run's",
    ),
    (
        "optimizer JSON not JSON, checksum forged",
        lambda c: (c / "optimizer.json").write_text("{"),
        "optimizer.json",
        "cannot read",
    ),
    ("scheduler state deleted", _delete("scheduler.json"), None, "scheduler.json is missing"),
    ("adapter weights truncated", _truncate("trainable.safetensors", 0.9), None, "bytes but was"),
    (
        "adapter weights garbage, checksum forged",
        lambda c: (c / "trainable.safetensors").write_bytes(b"\0" * 64),
        "trainable.safetensors",
        "cannot read",
    ),
    (
        "callbacks of another run, checksum forged",
        _edit_json("callbacks.json", _add_a_callback),
        "callbacks.json",
        "holds the states of callbacks",
    ),
    ("trainer state truncated", _truncate("trainer_state.json"), None, "bytes but was"),
    (
        "trainer state truncated, checksum forged",
        _truncate("trainer_state.json"),
        "trainer_state.json",
        "cannot read",
    ),
    (
        "step not a number, checksum forged",
        _edit_json("trainer_state.json", lambda v: v.update(global_step="one")),
        "trainer_state.json",
        "global_step='one' is not a valid value",
    ),
    ("manifest truncated", _truncate("manifest.json"), None, "cannot read"),
    ("manifest missing", _delete("manifest.json"), None, "neither a checkpoint"),
]


@pytest.mark.parametrize(("edit", "forged", "message"), [c[1:] for c in DAMAGE], ids=[c[0] for c in DAMAGE])
def test_a_damaged_or_edited_state_file_is_refused(edit, forged, message, run_copy, forge):
    edit(run_copy.checkpoint)
    if forged is not None:
        forge(run_copy.checkpoint, forged)
    with pytest.raises(ResumeError, match=message):
        run_copy.resume()


@pytest.mark.parametrize(
    ("options", "difference"), [({"alpha": 16.0}, "lora_alpha"), ({"dropout": 0.0}, "lora_dropout")]
)
def test_resume_refuses_another_lora_alpha_or_dropout(options, difference, run_copy):
    with pytest.raises(ResumeError, match=f"belongs to another run: adapter.default.{difference}"):
        run_copy.resume(model_options=options)


# -- the commands' resume ---------------------------------------------------------------------


def test_a_pickle_in_a_resumed_finetune_never_runs(
    llama_dir, train_text, finetune_run, finetune_args, pickle_bomb, forge, tmp_path, capsys
):
    """One payload, its checksum forged: `finetune --resume-from-checkpoint` exits 2 with one line."""
    from quantlab.cli.main import main

    run = tmp_path / "run"
    shutil.copytree(finetune_run, run)
    checkpoint = run / "checkpoint-4"
    (checkpoint / "random_states_0.json").write_bytes(pickle_bomb.torch_file)
    forge(checkpoint, "random_states_0.json")
    capsys.readouterr()
    assert main(finetune_args(llama_dir, train_text, run, "--resume-from-checkpoint", "latest")) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"quantlab: error: cannot read {checkpoint / 'random_states_0.json'}: "), lines
    assert lines[0].endswith("resume from another checkpoint or start a new run"), lines
    assert not pickle_bomb.ran()


def test_a_pickle_in_a_resumed_finetune_prune_and_distill_run_never_runs(
    llama_dir, train_text, finetune_run, pickle_bomb, forge, tmp_path, capsys
):
    """Payloads in the files each command's resume reads, checksums forged to match: exit 2, one line."""
    from quantlab.cli.main import main

    run = tmp_path / "finetune"
    shutil.copytree(finetune_run, run)
    checkpoint = run / "checkpoint-4"
    (checkpoint / "optimizer.safetensors").write_bytes(pickle_bomb.torch_file)
    forge(checkpoint, "optimizer.safetensors")
    finetune = ["finetune", llama_dir, "--max-steps", "4", "-o", run, "--data", train_text, "--lora-r", "4"]
    finetune += ["--max-seq-length", "32", "--eval-windows", "0", "--learning-rate", "1e-2", "--save-steps", "2"]
    finetune += ["--resume-from-checkpoint", "latest"]

    long_text = tmp_path / "long.txt"  # prune and distill hold out 16 windows of 512 tokens
    long_text.write_text(train_text.read_text() * 4)
    training = ["--max-seq-length", "16", "--batch-size", "2", "--data", long_text, "--save-steps", "1"]
    commands = {"finetune": [*map(str, finetune)]}
    for command in ("prune", "distill"):
        run_dir = tmp_path / f"{command}-run"
        if command == "prune":
            argv = ["prune", llama_dir, "--pattern", "unstructured", "--sparsity", "0.5", "--max-steps", "2"]
        else:
            argv = ["distill", "--teacher", llama_dir, "--student", llama_dir, "--max-steps", "2"]
        argv = [*map(str, argv), *map(str, training), "-o", str(run_dir), "--quiet"]
        assert main(argv) == 0
        checkpoint = run_dir / "checkpoint-2"
        (checkpoint / "callbacks.json").write_bytes(pickle_bomb.torch_file)
        forge(checkpoint, "callbacks.json")
        commands[command] = [*argv, "--resume-from-checkpoint"]

    for command, argv in commands.items():
        capsys.readouterr()
        assert main(argv) == 2, command
        errors = capsys.readouterr().err
        lines = [line for line in errors.splitlines() if line.strip()]
        assert lines[-1].startswith("quantlab: error: cannot read"), (command, lines)
        assert "Traceback" not in errors
        assert not pickle_bomb.ran(), command
