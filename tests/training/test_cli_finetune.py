"""`quantlab finetune` end to end on a tiny checkpoint, and its bad-input errors."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from quantlab.cli.main import main
from quantlab.testing import tiny_llama, tiny_model_dir

TINY = [
    "--lora-r",
    "4",
    "--max-seq-length",
    "32",
    "--eval-windows",
    "2",
    "--eval-seq-len",
    "64",
    "--learning-rate",
    "1e-2",
]


@pytest.fixture
def tiny_checkpoint(tmp_path, tokenizer):
    folder = tiny_model_dir(tiny_llama(0), tmp_path / "tiny")
    tokenizer.save_pretrained(folder)
    text = tmp_path / "train.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 80)
    return folder, text


def _last_json(captured: str) -> dict:
    return json.loads(captured.strip().splitlines()[-1])


def test_finetune_trains_merges_and_reports(tiny_checkpoint, tmp_path, capsys):
    folder, text = tiny_checkpoint
    output = tmp_path / "run"
    base = ["finetune", str(folder), "--method", "nf4", "--blocksize", "32", "--output-dir", str(output)]
    base += ["--data", str(text), *TINY, "--save-steps", "3", "--lr-scheduler-type", "constant", "--json"]
    assert main([*base, "--max-steps", "6", "--merge", "float"]) == 0
    report = _last_json(capsys.readouterr().out)
    assert report["steps"] == 6 and report["processes"] == 1
    assert report["base"].startswith("nf4") and "blocksize=32" in report["base"]
    assert report["perplexity_after"] < report["perplexity_before"]
    assert report["merge"]["mode"] == "float" and report["merge"]["max_logit_difference"] <= 1e-4
    assert (output / "final" / "adapter_config.json").is_file()
    assert (output / "merged" / "config.json").is_file() and (output / "quantlab_report.json").is_file()
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]

    assert main([*base, "--max-steps", "7", "--resume-from-checkpoint"]) == 0  # a constant schedule may run longer
    assert _last_json(capsys.readouterr().out)["steps"] == 7


def test_qa_lora_merges_into_the_quantized_base_without_rounding_the_update(tiny_checkpoint, tmp_path, capsys):
    """QA-LoRA on an asymmetric base: `--merge quantized` moves only the zero points, so the merged model
    computes what the adapter model did (a plain LoRA merge re-quantizes and changes the logits)."""
    folder, text = tiny_checkpoint
    output = tmp_path / "run"
    argv = ["finetune", str(folder), "--method", "custom_bits", "--group-size", "32", "--scale-dtype", "float32"]
    argv += ["--qa-lora", "32", "--output-dir", str(output), "--data", str(text), *TINY, "--max-steps", "4"]
    assert main([*argv, "--merge", "quantized", "--json"]) == 0
    report = _last_json(capsys.readouterr().out)
    assert report["merge"]["mode"] == "quantized" and report["merge"]["max_logit_difference"] <= 1e-3
    assert (output / "merged" / "config.json").is_file()


def test_qa_lora_on_a_base_without_zero_points_is_one_clear_line(tiny_checkpoint, tmp_path, capsys):
    folder, text = tiny_checkpoint
    argv = ["finetune", str(folder), "--method", "custom_bits", "--symmetric", "--qa-lora", "64", "--max-steps", "1"]
    assert main([*argv, "--output-dir", str(tmp_path / "run"), "--data", str(text), *TINY]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "QA-LoRA merges into zero points" in error[0]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--method", "nf4", "--bitsandbytes"], "pass one of them"),
        (["--target-modules", "q_proj,qkv"], "'qkv' matches no Linear layer"),
        (["--optim", "sgd_9bit"], "training argument optim='sgd_9bit': choose one of adamw_torch"),
        (["--training-arg", "save_step=3"], "did you mean save_steps"),
        (["--resume-from-checkpoint", "latest"], "holds no complete checkpoint"),
        (["--method", "no_such_method"], "unknown quantization method 'no_such_method'"),
        (["--max-steps", "0"], "--max-steps must be at least 1"),
    ],
)
def test_bad_input_is_one_clear_line(extra, message, tiny_checkpoint, tmp_path, capsys):
    folder, text = tiny_checkpoint
    argv = [
        "finetune",
        str(folder),
        "--max-steps",
        "2",
        "--output-dir",
        str(tmp_path / "run"),
        "--data",
        str(text),
        *TINY,
    ]
    assert main([*argv, *extra]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("quantlab: error:") and message in error[-1]


def test_float_base_lora_saves_the_adapter_only(tiny_checkpoint, tmp_path, capsys):
    folder, text = tiny_checkpoint
    output = tmp_path / "run"
    argv = [
        "finetune",
        str(folder),
        "--max-steps",
        "2",
        "--output-dir",
        str(output),
        "--data",
        str(text),
        *TINY,
        "--json",
    ]
    assert main(argv) == 0
    assert _last_json(capsys.readouterr().out)["base"] == "float32"
    saved = load_file(str(output / "final" / "adapter_model.safetensors"))
    assert saved and all("lora_" in name for name in saved)


def test_quiet_bitsandbytes_run_leaves_out_library_chatter(tiny_checkpoint, tmp_path):
    """bitsandbytes logs on import when its optional hub kernels are missing, PEFT and transformers
    warn of deprecations: --quiet leaves those out (warnings about results, if any, still show)."""
    folder, text = tiny_checkpoint
    argv = ["finetune", folder, "--bitsandbytes", "--max-steps", "1", "--output-dir", tmp_path / "run", "--data", text]
    command = [sys.executable, "-m", "quantlab.cli.main", *map(str, [*argv, *TINY, "--quiet"])]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "kernels-community" not in result.stderr and "Deprecat" not in result.stderr, result.stderr
    assert "FutureWarning" not in result.stderr, result.stderr
