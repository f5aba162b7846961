"""Two processes (torchrun, DDP over gloo on CPU, on Trainer) train like one process with the same global batch
(the one process is the test's own)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from quantlab.cli.main import main
from quantlab.testing import tiny_llama, tiny_model_dir
from quantlab.training import read_log

TINY = ["--lora-r", "4", "--lora-dropout", "0", "--max-seq-length", "32", "--eval-windows", "2", "--eval-seq-len", "64"]


def _finetune_arguments(folder, text, output, batch_size: int) -> list[str]:
    arguments = ["finetune", str(folder), "--method", "nf4", "--blocksize", "32", "--max-steps", "3"]
    arguments += ["--learning-rate", "1e-2", "--output-dir", str(output), "--data", str(text)]
    return [*arguments, "--batch-size", str(batch_size), *TINY, "--save-steps", "3", "--json"]


def _finetune_in_two_processes(folder, text, output, batch_size: int) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*launcher, "-m", "quantlab.cli.main", *_finetune_arguments(folder, text, output, batch_size)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env=environment)


@pytest.mark.subprocess
def test_two_processes_match_one_and_write_one_checkpoint(tmp_path, tokenizer):
    folder = tiny_model_dir(tiny_llama(0), tmp_path / "tiny")
    tokenizer.save_pretrained(folder)
    text = tmp_path / "train.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 80)

    two = _finetune_in_two_processes(folder, text, tmp_path / "two", batch_size=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert main(_finetune_arguments(folder, text, tmp_path / "one", batch_size=4)) == 0  # one process: this one

    reports = [json.loads(line) for line in two.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and reports[0]["processes"] == 2  # only the main process reports
    checkpoint = tmp_path / "two" / "checkpoint-3"
    assert {"random_states_0.json", "random_states_1.json", "trainable.safetensors"} <= {
        p.name for p in checkpoint.iterdir()
    }
    log = read_log(tmp_path / "two")
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3]  # one log, not one per process

    # Same global batch of 4 examples per step: DDP must give the single-process update.
    adapters = [load_file(str(tmp_path / run / "final" / "adapter_model.safetensors")) for run in ("two", "one")]
    assert adapters[0].keys() == adapters[1].keys()
    for name in adapters[0]:
        torch.testing.assert_close(adapters[0][name], adapters[1][name], rtol=1e-4, atol=1e-6, msg=name)
    one_log = read_log(tmp_path / "one")
    assert [r["loss"] for r in log if "loss" in r] == pytest.approx([r["loss"] for r in one_log if "loss" in r])
