"""Bad input at the command line: exit 2, one line naming the fault, no traceback, and no input lost.

One table, one row per case: how to set it up, the command, and the fragment the error line
must hold. The commands run in this process (`quantlab.cli.main.main`), as the console script
would; `test_signals.py` runs the cases that need a process of their own.
"""

import errno
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import quantlab
from quantlab.cli.main import main
from quantlab.testing import byte_tokenizer, tiny_llama
from quantlab.testing.disks import small_tmpfs

LAYER = "model.layers.0.mlp.up_proj"


def _quantized(directory: Path) -> Path:
    model = tiny_llama()
    quantlab.quantize(model, quantlab.CustomBitsConfig(bits=4, group_size=64))
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def _edit_config(directory: Path, option: str, value) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"][option] = value
    (directory / "config.json").write_text(json.dumps(config))


def _cut_codes(directory: Path) -> None:
    tensors = load_file(directory / "model.safetensors")
    tensors[f"{LAYER}.weight"] = tensors[f"{LAYER}.weight"][:, :, :4].clone()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


class Setup:
    """What a case gets: a scratch folder, the tiny model, training text, a finished finetune run."""

    def __init__(self, tmp_path: Path, llama_dir: Path, text: Path, finetune_run: Path, finetune_args) -> None:
        self.tmp, self.llama, self.text, self._run, self._finetune_args = (
            tmp_path,
            llama_dir,
            text,
            finetune_run,
            finetune_args,
        )

    def quantized(self, edit: Callable[[Path], None]) -> Path:
        directory = _quantized(self.tmp / "quantized")
        edit(directory)
        return directory

    def model_inside(self, folder: str) -> Path:
        """A copy of the tiny model at `folder/model`; returns `folder`."""
        shutil.copytree(self.llama, self.tmp / folder / "model")
        return self.tmp / folder

    def existing(self, name: str, kind: str = "folder") -> Path:
        path = self.tmp / name
        if kind == "file":
            path.write_text("keep me")
        else:
            path.mkdir()
            (path / "keep").write_text("keep me")
        return path

    def run_copy(self, damage: Callable[[Path], None]) -> Path:
        run = self.tmp / "run"
        shutil.copytree(self._run, run)
        damage(run / "checkpoint-4")
        return run

    def finetune(self, output: Path, *extra: str, model: Path | None = None) -> list[str]:
        return self._finetune_args(model or self.llama, self.text, output, *extra)


def _flip_last_byte(name: str) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        data = bytearray((checkpoint / name).read_bytes())
        data[-1] ^= 0xFF
        (checkpoint / name).write_bytes(bytes(data))

    return damage


def _truncate(name: str) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        data = (checkpoint / name).read_bytes()
        (checkpoint / name).write_bytes(data[: len(data) // 2])

    return damage


def _eval(folder: Path) -> list[str]:
    return ["eval", str(folder), "--windows", "1", "--seq-len", "16", "--quiet"]


def _quantize(model: Path, output: Path | str, *extra: str) -> list[str]:
    return ["quantize", str(model), "--method", "int8", "--output", str(output), "--quiet", *extra]


def _prune(model: Path, output: Path, *extra: str) -> list[str]:
    return ["prune", str(model), "--pattern", "unstructured", "--sparsity", "0.5", "-o", str(output), "--quiet", *extra]


def _distill(teacher: Path, student: Path, output: Path, *extra: str) -> list[str]:
    argv = ["distill", "--teacher", str(teacher), "--student", str(student), "--max-steps", "1", "-o", str(output)]
    return [*argv, "--max-seq-length", "16", "--quiet", *extra]


def _export(kind: str, model: Path, output: Path | str, *extra: str) -> list[str]:
    return ["export", kind, str(model), "--output", str(output), "--quiet", *extra]


def _symlink(link: Path, target: Path) -> Path:
    link.symlink_to(target, target_is_directory=True)
    return link


# case id -> (command for a Setup, fragment of the one error line)
CASES: dict[str, tuple[Callable[[Setup], list[str]], str]] = {
    "unknown quant_method": (
        lambda s: _eval(s.quantized(lambda d: _edit_config(d, "quant_method", "nope"))),
        "names quant_method='nope', which no installed method reads",
    ),
    "codes of the wrong shape": (
        lambda s: _eval(s.quantized(_cut_codes)),
        f"{LAYER}.weight in model.safetensors is uint8 [192, 1, 4] but its layout needs uint8 [192, 1, 32]",
    ),
    "format_version not a number": (
        lambda s: _eval(s.quantized(lambda d: _edit_config(d, "format_version", "one"))),
        "format_version='one'",
    ),
    "quantize X/model -o X --overwrite": (
        lambda s: _quantize(s.model_inside("x") / "model", s.tmp / "x", "--overwrite"),
        "contains the input",
    ),
    "prune X/model -o X --overwrite": (
        lambda s: _prune(s.model_inside("x") / "model", s.tmp / "x", "--overwrite"),
        "contains the input",
    ),
    "distill --student X/model -o X --overwrite": (
        lambda s: _distill(s.llama, s.model_inside("x") / "model", s.tmp / "x", "--overwrite"),
        "contains the input",
    ),
    "export compressed-tensors X/model -o X --overwrite": (
        lambda s: _export("compressed-tensors", s.model_inside("x") / "model", s.tmp / "x", "--overwrite"),
        "contains the input",
    ),
    "export compressed-tensors X/model -o X/model --overwrite": (
        lambda s: _export("compressed-tensors", s.model_inside("x") / "model", s.tmp / "x" / "model", "--overwrite"),
        "is the input",
    ),
    "export onnx X/model -o X/model/m.onnx": (
        lambda s: _export("onnx", s.model_inside("x") / "model", s.tmp / "x" / "model" / "m.onnx"),
        "lies inside the input folder",
    ),
    "export gguf X/model -o X --overwrite": (
        lambda s: _export("gguf", s.model_inside("x") / "model", s.tmp / "x", "--overwrite"),
        "contains the input",
    ),
    "export onnx -o an existing file": (
        lambda s: _export("onnx", s.llama, s.existing("m.onnx", "file")),
        "already exists; pass --overwrite",
    ),
    "export gguf -o an existing file": (
        lambda s: _export("gguf", s.llama, s.existing("m.gguf", "file")),
        "already exists; pass --overwrite",
    ),
    "export compressed-tensors -o an existing folder": (
        lambda s: _export("compressed-tensors", s.llama, s.existing("ct")),
        "already exists; pass --overwrite",
    ),
    "quantize X -o X/sub (inside the input)": (
        lambda s: _quantize(s.model_inside("x") / "model", s.tmp / "x" / "model" / "sub"),
        "lies inside the input folder",
    ),
    "quantize X -o LINK --overwrite (LINK -> X)": (
        lambda s: _quantize(
            s.model_inside("x") / "model", _symlink(s.tmp / "link", s.tmp / "x" / "model"), "--overwrite"
        ),
        "is the input",
    ),
    "finetune -o a folder inside the model": (
        lambda s: s.finetune(s.tmp / "x" / "model" / "run", model=s.model_inside("x") / "model"),
        "lies inside the input folder",
    ),
    "prune X -o X/run": (
        lambda s: _prune(s.model_inside("x") / "model", s.tmp / "x" / "model" / "run"),
        "lies inside the input folder",
    ),
    "finetune -o an existing file": (
        lambda s: s.finetune(s.existing("run", kind="file")),
        "is a file; the run needs a folder there",
    ),
    "finetune -o an existing folder": (
        lambda s: s.finetune(s.existing("run")),
        "already exists; pass --resume-from-checkpoint to continue its run, --overwrite to replace it",
    ),
    "finetune --overwrite of a folder holding the data": (
        lambda s: [
            *s.finetune(s.model_inside("x")),
            "--overwrite",
            "--data",
            str(s.tmp / "x" / "model" / "config.json"),
        ],
        "contains the input",
    ),
    "prune --run-dir (removed)": (
        lambda s: _prune(s.llama, s.tmp / "out", "--max-steps", "1", "--run-dir", str(s.tmp / "r")),
        "unrecognized arguments: --run-dir",
    ),
    "prune -o an existing file": (
        lambda s: _prune(s.llama, s.existing("out", "file")),
        "is a file; the run needs a folder there",
    ),
    "prune -o an existing folder": (
        lambda s: _prune(s.llama, s.existing("out")),
        "already exists; pass --resume-from-checkpoint",
    ),
    "distill -o an existing folder": (
        lambda s: _distill(s.llama, s.llama, s.existing("out")),
        "already exists; pass --resume-from-checkpoint",
    ),
    "corrupt optimizer state on resume": (
        lambda s: s.finetune(
            s.run_copy(_flip_last_byte("optimizer.safetensors")), "--resume-from-checkpoint", "latest"
        ),
        "optimizer.safetensors does not match the checksum recorded when it was saved",
    ),
    "truncated RNG state on resume": (
        lambda s: s.finetune(
            s.run_copy(_truncate("random_states_0.safetensors")), "--resume-from-checkpoint", "latest"
        ),
        "random_states_0.safetensors is 5092 bytes but was 10184 when saved",
    ),
    "RNG state deleted on resume": (
        lambda s: s.finetune(
            s.run_copy(lambda c: (c / "random_states_0.json").unlink()), "--resume-from-checkpoint", "latest"
        ),
        "random_states_0.json is missing",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_exit_2_and_one_line(case, tmp_path, llama_dir, train_text, finetune_run, finetune_args, capsys):
    command, fragment = CASES[case]
    setup = Setup(tmp_path, llama_dir, train_text, finetune_run, finetune_args)
    argv = command(setup)
    before = _snapshot(tmp_path)
    capsys.readouterr()
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("quantlab: error: "), lines
    assert fragment in lines[0], (fragment, lines[0])
    assert _snapshot(tmp_path) == before  # nothing written, nothing deleted, no staging left


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cwd_overwrite_is_refused(tmp_path, llama_dir, monkeypatch, capsys):
    """`-o . --overwrite` would delete the folder the user stands in (and everything below it)."""
    (tmp_path / "keep").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    assert main(_quantize(llama_dir, ".", "--overwrite")) == 2
    assert "is or contains the current directory" in capsys.readouterr().err
    assert main(_quantize(llama_dir, ".")) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]


def test_finetune_overwrite_replaces_the_previous_run(tmp_path, llama_dir, train_text, finetune_args, capsys):
    output = tmp_path / "run"
    output.mkdir()
    (output / "old-run-file").write_text("old")
    assert main(finetune_args(llama_dir, train_text, output, "--overwrite")) == 0
    assert not (output / "old-run-file").exists()
    assert (output / "final" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_full_disk_during_finetune_names_the_checkpoint_to_resume(
    tmp_path, llama_dir, train_text, finetune_args, monkeypatch, capsys
):
    """As quantize's in-process full-disk test: safetensors fails as it does on a full disk, at step 4."""
    from safetensors import SafetensorError

    import quantlab.training.state_files as state_files

    save = state_files.save_file

    def full_at_step_4(tensors, path, *args, **kwargs):
        if "checkpoint-4" in str(path):
            raise SafetensorError(
                f"Error while serializing: I/O error: No space left on device (os error {errno.ENOSPC})"
            )
        return save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(state_files, "save_file", full_at_step_4)
    output = tmp_path / "run"
    assert main(finetune_args(llama_dir, train_text, output)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    checkpoint = output / "checkpoint-2"
    assert lines == [
        f"quantlab: error: no space left on the device while training into {output}; its last complete checkpoint, "
        f"{checkpoint}, is intact: free some space and resume the run"
    ]
    assert sorted(p.name for p in output.glob("*checkpoint-*")) == ["checkpoint-2"]  # no half-written one

    monkeypatch.setattr(state_files, "save_file", save)
    assert main(finetune_args(llama_dir, train_text, output, "--resume-from-checkpoint", "latest")) == 0
    assert (output / "final" / "adapter_model.safetensors").is_file()


@pytest.fixture
def small_disk(tmp_path: Path, finetune_run: Path):
    """A tmpfs with room for one training checkpoint, not two (needs root and mount; skipped elsewhere)."""
    pages = sum(-(-p.stat().st_size // 4096) for p in (finetune_run / "checkpoint-2").iterdir())
    with small_tmpfs(tmp_path / "disk", pages * 3 // 2 * 4) as mountpoint:
        yield mountpoint


def test_a_disk_that_fills_up_during_finetune_keeps_the_last_checkpoint(
    small_disk, tmp_path, llama_dir, train_text, finetune_args, capsys
):
    output = small_disk / "run"
    assert main(finetune_args(llama_dir, train_text, output)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "no space left on the device while training into" in lines[0], lines
    assert "checkpoint-2, is intact" in lines[0]
    assert sorted(p.name for p in output.glob("*checkpoint-*")) == ["checkpoint-2"]

    moved = tmp_path / "run"  # the checkpoint is whole: the run continues once there is room
    shutil.copytree(output, moved)
    assert main(finetune_args(llama_dir, train_text, moved, "--resume-from-checkpoint", "latest")) == 0
    assert (moved / "final" / "adapter_model.safetensors").is_file()
