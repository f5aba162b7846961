"""Signals at set points of quantize, save and checkpoint, in a process of their own.

Each run is the real command (`quantlab.cli.main.main`) with one function wrapped so the
process signals itself at that point: once a block of a streamed quantization is written, or
while a training checkpoint is. Afterwards the previous output must be intact, nothing that
looks finished left behind (a quantization's partial folder is hidden; the next run resumes or
removes it), a pickle planted in a run folder must not have run, and a resumed run must end
bit-identical to an uninterrupted one. Runs
that nothing interrupts, and refusals that happen before anything trains, run in this process.
"""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantlab.cli.main import main

pytestmark = pytest.mark.subprocess


def _run(script: str, *argv: str | os.PathLike, signal_number: int = 0, when: str = "") -> subprocess.CompletedProcess:
    """Run `main(argv)` in a fresh process, after `script` wrapped its function to send `signal_number`."""
    code = (
        textwrap.dedent(
            """
        import signal, sys
        from quantlab.cli.main import main
        SIGNAL, WHEN = int(sys.argv[1]), sys.argv[2]
        # Ctrl-C as in a terminal: a shell's background job (CI run with `&`) starts with SIGINT ignored,
        # and Python then installs no KeyboardInterrupt handler, so the CLI would never see it
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def signalling(function):
            def wrapped(*args, **kwargs):
                result = function(*args, **kwargs)
                if SIGNAL and WHEN in " ".join(map(str, args)):
                    signal.raise_signal(SIGNAL)  # to this (the main) thread
                return result
            return wrapped
        """
        )
        + textwrap.dedent(script)
        + "\nsys.exit(main(sys.argv[3:]))\n"
    )
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", code, str(signal_number), when, *map(str, argv)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)


QUANTIZE_BLOCK = """
from quantlab.streaming.partial import PartialOutput
PartialOutput.complete = signalling(PartialOutput.complete)
"""
CHECKPOINT_SAVE = """
import quantlab.training.checkpoints as checkpoint
checkpoint.save_trainable = signalling(checkpoint.save_trainable)
"""


def _quantize_argv(model: Path, output: Path) -> list[str]:
    return ["quantize", str(model), "--method", "int8", "--output", str(output), "--overwrite", "--quiet"]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _weights_and_configs(folder: Path) -> dict[str, bytes]:
    """What a checkpoint holds, less its report (which records times)."""
    return {name: data for name, data in _files(folder).items() if name != "quantlab_report.json"}


@pytest.mark.parametrize(("signal_number", "exit_code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_quantize_leaves_the_previous_output_and_resumes_exactly(
    signal_number, exit_code, llama_dir, tmp_path
):
    output = tmp_path / "out"
    output.mkdir()
    (output / "previous").write_text("the previous checkpoint")
    argv = _quantize_argv(llama_dir, output)
    result = _run(QUANTIZE_BLOCK, *argv, signal_number=signal_number, when="model.layers.0")
    assert result.returncode == exit_code, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert _files(output) == {"previous": b"the previous checkpoint"}
    [partial] = [p for p in tmp_path.iterdir() if p.name != "out"]
    assert partial.name.startswith(".out.partial-") and not (partial / "config.json").exists()
    assert main([*argv, "--resume"]) == 0  # here in this process
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert main(_quantize_argv(llama_dir, tmp_path / "straight")) == 0
    assert _weights_and_configs(output) == _weights_and_configs(tmp_path / "straight")


def test_sigkill_leaves_a_partial_folder_that_the_next_run_removes(llama_dir, tmp_path):
    output = tmp_path / "out"
    result = _run(QUANTIZE_BLOCK, *_quantize_argv(llama_dir, output), signal_number=signal.SIGKILL, when="layers.1")
    assert result.returncode == -signal.SIGKILL
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".out.partial-"), leftovers
    assert main(_quantize_argv(llama_dir, output)) == 0  # the next run (no --resume), here in this process
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (output / "config.json").is_file()


def test_sigterm_during_a_training_checkpoint_then_resume_is_bit_identical(
    llama_dir, train_text, finetune_args, pickle_bomb, tmp_path, capsys
):
    """Three tiny training runs in fresh processes: uninterrupted, stopped at step 4's checkpoint, resumed."""
    straight = _run("", *finetune_args(llama_dir, train_text, tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-2000:]

    run = tmp_path / "run"
    killed = _run(
        CHECKPOINT_SAVE, *finetune_args(llama_dir, train_text, run), signal_number=signal.SIGTERM, when="checkpoint-4"
    )
    assert killed.returncode == 143, killed.stderr[-2000:]
    assert sorted(p.name for p in run.glob("*checkpoint-*")) == ["checkpoint-2"]  # no half-written step 4
    planted = run / "checkpoint-2" / "optimizer.pt"  # transformers' pickled optimizer state: refused, never read
    planted.write_bytes(pickle_bomb.torch_file)
    resume = finetune_args(llama_dir, train_text, run, "--resume-from-checkpoint", "latest")
    capsys.readouterr()
    assert main(resume) == 2  # refused before it trains: this process will do
    assert "optimizer.pt was not written with this checkpoint" in capsys.readouterr().err
    assert not pickle_bomb.ran()
    planted.unlink()

    resumed = _run("", *resume)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected = load_file(tmp_path / "straight" / "final" / "adapter_model.safetensors")
    got = load_file(run / "final" / "adapter_model.safetensors")
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_two_quantize_processes_writing_one_output_one_wins_whole(llama_dir, tmp_path):
    """Without --overwrite, the second writer is refused at its start or at its rename, never replaces."""
    output = tmp_path / "out"
    argv = ["quantize", str(llama_dir), "--method", "int8", "--output", str(output), "--quiet"]
    code = "import sys; from quantlab.cli.main import main; sys.exit(main(sys.argv[1:]))"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    writers = [
        subprocess.Popen([sys.executable, "-c", code, *argv], stderr=subprocess.PIPE, text=True, env=environment)
        for _ in range(2)
    ]
    results = [(writer.wait(timeout=600), writer.stderr.read()) for writer in writers]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(stderr for code, stderr in results if code == 2)
    assert "already exists" in refused or "appeared while this command ran" in refused, refused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert {"config.json", "model.safetensors"} <= {p.name for p in output.iterdir()}
