"""`torchrun --nproc-per-node 2 -m quantlab quantize ...`: the one-process checkpoint, written and reported once."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantlab.testing import byte_tokenizer, tiny_llama_checkpoint

WORLD = 2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("models") / "tiny-llama", tokenizer=byte_tokenizer())


def _quantize_command(model: Path, output: Path, *extra: str) -> list[str]:
    return [
        *("quantize", str(model), "-o", str(output), "--method", "custom_bits", "--solver", "gptq"),
        *("--calibration-samples", "16", "--calibration-seq-len", "32", *extra),
    ]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD)]
    command += ["--master-port", str(_free_port()), "-m", "quantlab", *args]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)


def test_torchrun_writes_the_one_process_checkpoint_once(llama_dir, tmp_path):
    from quantlab.cli.main import main

    result = _torchrun(*_quantize_command(llama_dir, tmp_path / "together"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(f"quantized {llama_dir} -> ") == 1  # rank 0 alone prints
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(_quantize_command(llama_dir, tmp_path / "alone", "--quiet")) == 0
    finally:
        torch.set_num_threads(threads)
    together = (tmp_path / "together" / "model.safetensors").read_bytes()
    assert together == (tmp_path / "alone" / "model.safetensors").read_bytes()
    assert '"processes": 2' in (tmp_path / "together" / "quantlab_report.json").read_text()


def test_a_failure_under_torchrun_is_one_line(llama_dir, tmp_path):
    result = _torchrun(*_quantize_command(llama_dir, tmp_path / "out", "--calibration-samples", "8"))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("quantlab: error:")]
    assert len(errors) == 1 and "--calibration-samples 16 or more" in errors[0], result.stderr
    assert not re.search(r'File "[^"]*/quantlab/', result.stderr)  # torchrun's own summary follows, not ours
    assert not (tmp_path / "out").exists()


def test_a_one_process_command_under_torchrun_is_refused_in_one_line(llama_dir, monkeypatch, capsys):
    from quantlab.cli.main import main

    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    monkeypatch.setenv("RANK", "0")
    assert main(["inspect", str(llama_dir)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("quantlab: error: 'inspect' runs in one process") and "\n" not in error
    assert "finetune" in error and "quantize" in error
