"""`quantlab distill` end to end on tiny checkpoints, in process."""

import json

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import quantlab
from quantlab.cli.main import main
from quantlab.testing import tiny_llama
from quantlab.training import read_log

TRAIN = ["--max-seq-length", "32", "--batch-size", "2", "--learning-rate", "1e-3"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_distill_trains_the_student_and_saves_it(tmp_path, capsys, make_checkpoint):
    teacher, student = make_checkpoint(tmp_path / "teacher", 0), make_checkpoint(tmp_path / "student", 1)
    argv = ["distill", "--teacher", str(teacher), "--student", str(student), "--max-steps", "2", *TRAIN]
    code, out, _ = _run(capsys, *argv, "--output-dir", str(tmp_path / "out"), "--json")
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["steps"] == 2 and report["loss"] > 0
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final")
    original = AutoModelForCausalLM.from_pretrained(student)
    assert not bool((trained.model.layers[0].mlp.up_proj.weight == original.model.layers[0].mlp.up_proj.weight).all())


def test_quantized_student_needs_lora_and_stays_quantized(tmp_path, capsys, make_checkpoint):
    teacher = make_checkpoint(tmp_path / "teacher", 0)
    quantized = quantlab.quantize(tiny_llama(1), quantlab.NF4Config(blocksize=32))
    student = make_checkpoint(tmp_path / "student", model=quantized)
    argv = ["distill", "--teacher", str(teacher), "--student", str(student), "--max-steps", "2", *TRAIN]
    code, _, err = _run(capsys, *argv, "--output-dir", str(tmp_path / "out"))
    assert code == 2 and "--lora-r" in err
    code, _, err = _run(capsys, *argv, "--lora-r", "2", "--output-dir", str(tmp_path / "out"))
    assert code == 0, err
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final")
    assert type(merged.model.layers[0].mlp.up_proj).__name__ == "NF4Linear"


def test_vocabulary_mismatch_is_a_clear_error(tmp_path, capsys, make_checkpoint):
    teacher = make_checkpoint(tmp_path / "teacher", 0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "student")
    argv = ["distill", "--teacher", str(teacher), "--student", str(tmp_path / "student"), "--max-steps", "1"]
    code, _, err = _run(capsys, *argv, "--output-dir", str(tmp_path / "out"))
    assert code == 2
    assert "vocabularies differ" in err and "256" in err and "300" in err
    assert not (tmp_path / "out").exists()


def test_distill_run_folder_resumes_in_place(tmp_path, capsys, make_checkpoint):
    """A run with checkpoints every step; the run folder then resumes from its first checkpoint."""
    teacher, student = make_checkpoint(tmp_path / "teacher", 0), make_checkpoint(tmp_path / "student", 1)
    first_run = ["distill", "--teacher", str(teacher), "--student", str(student), "--max-steps", "2"]
    first_run += ["--output-dir", str(tmp_path / "out"), "--max-seq-length", "32", "--gradient-accumulation-steps", "1"]
    code, _, err = _run(capsys, *first_run, "--save-steps", "1")
    assert code == 0, err
    assert (tmp_path / "out" / "final" / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "out").glob("*checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert (tmp_path / "out" / "trainer_state.json").is_file() and (tmp_path / "out" / "quantlab_report.json").is_file()

    new = ["distill", "--teacher", str(teacher), "--student", str(student), "--max-steps", "2"]
    new += ["--max-seq-length", "32", "--save-steps", "1", "--output-dir", str(tmp_path / "out"), "--json"]
    code, _, err = _run(capsys, *new)
    assert code == 2 and "already exists; pass --resume-from-checkpoint" in err
    first = tmp_path / "out" / "checkpoint-1"
    code, out, err = _run(capsys, *new, "--resume-from-checkpoint", str(first))
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 2
    log = read_log(tmp_path / "out")
    assert [record["step"] for record in log if "loss" in record] == [1, 2]  # step 2 retrained once, from step 1
