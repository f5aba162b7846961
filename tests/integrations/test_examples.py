"""The examples users copy run as documented, at a tiny size: `qlora_finetune.py` in one process,
`distributed_finetune.py` under torchrun and under `accelerate launch` with 2 CPU processes."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.assets.text import bundled_text
from quantlab.eval import perplexity
from quantlab.testing import byte_tokenizer, tiny_llama_checkpoint

pytestmark = pytest.mark.subprocess

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BIN = Path(sys.executable).parent


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _json_lines(stdout: str) -> list[dict]:
    return [
        json.loads(line[line.index("{") :]) for line in stdout.splitlines() if '"process"' in line or '"steps"' in line
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("model") / "tiny")


def test_qlora_example_trains_and_measures_the_harness_perplexity(tiny_dir, tmp_path):
    script = EXAMPLES / "qlora_finetune.py"
    arguments = ["--model", tiny_dir, "--max-steps", "3", "--seq-len", "64", "--learning-rate", "1e-3"]
    result = _run([sys.executable, script, *map(str, arguments), "--output-dir", str(tmp_path / "run")], tmp_path)
    summary = _json_lines(result.stdout)[-1]
    assert summary["steps"] == 3
    # Its perplexity is the shared harness's: the NF4 model before training, scored by quantlab.eval.
    nf4 = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=quantlab.NF4Config())
    assert math.isclose(summary["perplexity_before"], perplexity(nf4, byte_tokenizer(), bundled_text()), rel_tol=1e-5)
    assert summary["perplexity_after"] < summary["perplexity_before"]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_qlora_example_resumes_from_its_newest_checkpoint(tiny_dir, tmp_path):
    script, output = EXAMPLES / "qlora_finetune.py", tmp_path / "run"
    common = ["--model", tiny_dir, "--seq-len", "32", "--save-steps", "2", "--no-eval", "--output-dir", output]
    _run([sys.executable, script, *map(str, common), "--max-steps", "2"], tmp_path)
    assert (output / "checkpoint-2").is_dir()
    resumed = _run(
        [sys.executable, script, *map(str, common), "--max-steps", "4", "--resume-from-checkpoint"], tmp_path
    )
    assert _json_lines(resumed.stdout)[-1]["steps"] == 4


def _check_two_processes(stdout: str) -> None:
    processes = [line for line in _json_lines(stdout) if "process" in line]
    assert sorted(line["process"] for line in processes) == [0, 1]
    assert {line["processes"] for line in processes} == {2}
    assert len({line["checksum"] for line in processes}) == 1  # gradients were averaged: one adapter
    assert "2 process(es), DistributedType.MULTI_CPU" in stdout


def test_distributed_example_under_torchrun_with_two_cpu_processes(tiny_dir, tmp_path):
    command = [BIN / "torchrun", "--nproc-per-node", "2", "--master-port", _free_port()]
    command += [EXAMPLES / "distributed_finetune.py", "--model", tiny_dir, "--max-steps", "2", "--seq-len", "64"]
    result = _run([*map(str, command), "--output-dir", str(tmp_path / "run")], tmp_path)
    _check_two_processes(result.stdout)
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()


def test_distributed_example_under_accelerate_launch_with_two_cpu_processes(tiny_dir, tmp_path):
    command = [BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", _free_port()]
    command += [EXAMPLES / "distributed_finetune.py", "--model", tiny_dir, "--max-steps", "2", "--seq-len", "64"]
    result = _run([*map(str, command), "--output-dir", str(tmp_path / "run")], tmp_path)
    _check_two_processes(result.stdout)
