"""`quantlab qat` end to end on tiny checkpoints: quantize-first, resume, bad input, a fresh process reloads."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from quantlab.cli.main import main

TRAIN = ["--max-seq-length", "32", "--batch-size", "2", "--learning-rate", "0.05", "--seed", "3"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _tensors(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_a_float_model_is_quantized_first_and_trained_against_itself(tmp_path, capsys, make_checkpoint):
    teacher = make_checkpoint(tmp_path / "float", 0)
    argv = ["qat", str(teacher), "--method", "custom_bits", "--bits", "3", "--group-size", "32", "--symmetric"]
    code, out, err = _run(capsys, *argv, "--max-steps", "3", *TRAIN, "-o", str(tmp_path / "run"), "--json")
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert (
        report["quantized_first"] and report["method"] == "quantlab_custom_bits" and report["teacher"] == str(teacher)
    )
    assert report["layers_trained"] == 14 and report["layers_from_float_weights"] == 14
    assert report["bits_per_quantized_weight"] == 3.5 and report["steps"] == 3
    start, final = _tensors(tmp_path / "run" / "start"), _tensors(tmp_path / "run" / "final")
    assert start.keys() == final.keys()
    assert all(final[key].dtype == start[key].dtype and final[key].shape == start[key].shape for key in start)
    assert any(not torch.equal(final[key], start[key]) for key in start if key.endswith("proj.weight"))
    # A fresh process reloads the result as the same quantized layers, with the same weights.
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM; import quantlab; "
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); layer = m.model.layers[1].mlp.down_proj; "
        "print(type(layer).__name__, float(layer.dequantize_weight().double().sum()))"
    )
    shown = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run" / "final")], capture_output=True,
                           text=True, env={**os.environ}, check=True).stdout.split()  # fmt: skip
    from transformers import AutoModelForCausalLM

    here = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").model.layers[1].mlp.down_proj
    assert shown == [type(here).__name__, str(float(here.dequantize_weight().double().sum()))]


def test_the_teacher_defaults_to_the_float_model_the_checkpoint_records(tmp_path, capsys, make_checkpoint):
    teacher = make_checkpoint(tmp_path / "float", 0)
    code, _, err = _run(capsys, "quantize", str(teacher), "--method", "custom_bits", "--bits", "2", "--group-size",
                        "32", "-o", str(tmp_path / "q2"), "--quiet")  # fmt: skip
    assert code == 0, err
    evaluation = ["--eval", "--eval-windows", "2", "--eval-seq-len", "64"]
    argv = ["qat", str(tmp_path / "q2"), "--max-steps", "2", *TRAIN, "-o", str(tmp_path / "run"), "--json"]
    code, out, err = _run(capsys, *argv, *evaluation)
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["teacher"] == str(teacher.resolve()) and not report["quantized_first"]
    assert report["perplexity_after"] > 0 and report["perplexity_teacher"] > 0


@pytest.mark.parametrize("train", ["weights", "grids"])
def test_resume_from_a_checkpoint_gives_the_uninterrupted_runs_codes(tmp_path, capsys, teacher_and_student, train):
    teacher, student = teacher_and_student
    argv = ["qat", str(student), "--teacher", str(teacher), "--max-steps", "3", *TRAIN, "-o", str(tmp_path / "run"),
            "--norm-lr-ratio", "0.5", "--embedding-lr-ratio", "0.5", "--train", train]  # fmt: skip
    code, _, err = _run(capsys, *argv, "--save-steps", "1", "--save-total-limit", "3")
    assert code == 0, err
    uninterrupted = _tensors(tmp_path / "run" / "final")
    for trained in ("model.norm.weight", "model.embed_tokens.weight"):
        assert not torch.equal(uninterrupted[trained], _tensors(student)[trained]), trained
    assert (tmp_path / "run" / "checkpoint-1" / "optimizer.json").is_file()
    assert not list((tmp_path / "run").rglob("*.pt")) and not list((tmp_path / "run").rglob("*.bin"))
    code, _, err = _run(capsys, *argv, "--save-steps", "1", "--save-total-limit", "3",
                        "--resume-from-checkpoint", str(tmp_path / "run" / "checkpoint-1"))  # fmt: skip
    assert code == 0, err
    resumed = _tensors(tmp_path / "run" / "final")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[key], uninterrupted[key]) for key in resumed)
    code, _, err = _run(capsys, *argv, "--save-steps", "1", "--scale-lr-ratio", "0.5", "--quiet",
                        "--resume-from-checkpoint", "latest")  # fmt: skip
    assert code == 2 and "resume" in err.lower() and len(err.strip().splitlines()) == 1


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, teacher_and_student):
    teacher, student = teacher_and_student
    out = ["--max-steps", "1", "-o", str(tmp_path / "run"), "--quiet"]
    cases = {
        "does not exist": ["qat", str(tmp_path / "missing"), *out],
        "is a float model; give --method": ["qat", str(teacher), *out],
        "is already quantized (quantlab_custom_bits); drop --method": ["qat", str(student), "--method", "nf4", *out],
        "records no float model": ["qat", str(student), *out],
        "the teacher must be the float model": ["qat", str(student), "--teacher", str(student), *out],
        "--max-steps N is required": ["qat", str(student), "--teacher", str(teacher), *out[2:]],
    }
    for expected, argv in cases.items():
        code, _, err = _run(capsys, *argv)
        assert code == 2, (expected, err)
        assert expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run" / "final").exists()


def test_resume_with_other_quantization_options_is_refused_naming_them(tmp_path, capsys, make_checkpoint):
    teacher = make_checkpoint(tmp_path / "float", 0)
    run = ["qat", str(teacher), "--method", "custom_bits", "--group-size", "32", "--symmetric", *TRAIN, "--quiet"]
    steps = ["--max-steps", "2", "--save-steps", "1", "-o", str(tmp_path / "r")]
    code, _, err = _run(capsys, *run, "--bits", "4", *steps)
    assert code == 0, err
    start = _tensors(tmp_path / "r" / "start")
    resume = ["--resume-from-checkpoint", str(tmp_path / "r" / "checkpoint-1")]
    code, _, err = _run(capsys, *run, "--bits", "3", *steps, *resume)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "started from a quantization with other options (bits 4 -> 3)" in err, err
    assert all(torch.equal(start[key], value) for key, value in _tensors(tmp_path / "r" / "start").items())
    code, _, err = _run(capsys, *run, "--bits", "4", *steps, *resume)
    assert code == 0, err  # the same options resume
