"""The prune, distill and finetune workflows called from Python, on the tiny Llama: reports, results, report files."""

import json
from pathlib import Path

import pytest

import quantlab
from quantlab.errors import QuantlabError
from quantlab.prune import load_sparse, masked_layers
from quantlab.testing import tiny_llama, tiny_llama_checkpoint
from quantlab.testing.models import tiny_bert
from quantlab.workflows import TrainingRun
from quantlab.workflows.distill import distill_model
from quantlab.workflows.finetune import FinetuneError, LoraOptions, finetune
from quantlab.workflows.prune import prune_model

TRAIN = {"per_device_train_batch_size": 2, "learning_rate": 1e-3}
SHORT = {"max_seq_length": 32, "eval_windows": 0}


def test_prune_then_recover_reports_and_saves_a_sparse_model(llama_dir: Path, tiny_text, tmp_path: Path) -> None:
    run = TrainingRun(tmp_path / "run", {"max_steps": 1, **TRAIN}, **SHORT)
    notes: list[str] = []
    report = prune_model(llama_dir, run, "2:4", evaluate=tiny_text, notify=notes.append)
    assert report.achieved_sparsity == pytest.approx(0.5)
    assert report.finetune_steps == 1 and report.finetune_loss > 0
    assert None not in (report.perplexity_before, report.perplexity_pruned, report.perplexity_after)
    assert report.linear_weights_stored_ratio <= 0.6
    assert len(masked_layers(load_sparse(tmp_path / "run" / "final"))) == 14
    saved = json.loads((tmp_path / "run" / "quantlab_report.json").read_text())
    assert saved == json.loads(json.dumps(report.as_dict()))
    assert any(note.startswith("pruning ") for note in notes)


def test_prune_without_recovery_leaves_out_the_recovery_fields(llama_dir: Path, tmp_path: Path) -> None:
    report = prune_model(llama_dir, TrainingRun(tmp_path / "run", **SHORT), "unstructured", 0.25)
    assert report.finetune_steps == 0 and report.perplexity_before is None
    assert "finetune_loss" not in report.as_dict()


def test_prune_refuses_a_quantized_model(tmp_path: Path) -> None:
    model = quantlab.quantize(tiny_llama(), quantlab.NF4Config(blocksize=32))
    folder = tiny_llama_checkpoint(tmp_path / "nf4", model=model)
    with pytest.raises(QuantlabError, match=r"already quantized \(quantlab_nf4\); prune its float original"):
        prune_model(folder, TrainingRun(tmp_path / "run"), "2:4")
    assert not (tmp_path / "run" / "final").exists()


def test_distill_trains_the_student_and_reports(llama_dir: Path, tmp_path: Path) -> None:
    student = tiny_llama_checkpoint(tmp_path / "student", seed=1)
    run = TrainingRun(tmp_path / "run", {"max_steps": 2, **TRAIN}, **SHORT)
    report = distill_model(llama_dir, student, run)
    assert report.steps == 2 and report.loss > 0 and report.alpha == 0.5
    assert report.output == str(tmp_path / "run" / "final")
    assert (tmp_path / "run" / "final" / "config.json").is_file()
    assert json.loads((tmp_path / "run" / "quantlab_report.json").read_text())["student"] == str(student)


def test_distill_refuses_an_encoder_student(tmp_path: Path) -> None:
    encoder = tmp_path / "bert"
    tiny_bert().save_pretrained(encoder)
    with pytest.raises(QuantlabError, match=r"is not a causal LM: distill trains next-token prediction.*quantlab qat"):
        distill_model(encoder, encoder, TrainingRun(tmp_path / "run", {"max_steps": 1, **TRAIN}, **SHORT))
    assert not (tmp_path / "run" / "final").exists()


def test_finetune_trains_adapters_on_a_quantized_base(llama_dir: Path, tmp_path: Path) -> None:
    run = TrainingRun(tmp_path / "run", {"max_steps": 2, **TRAIN}, max_seq_length=32, eval_windows=2, eval_seq_len=64)
    report = finetune(llama_dir, run, quantization=quantlab.NF4Config(blocksize=32), lora=LoraOptions(r=4))
    assert report.steps == 2 and report.lora_r == 4 and report.base.startswith("nf4")
    assert report.perplexity_before is not None and report.perplexity_after is not None
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()
    assert json.loads((tmp_path / "run" / "quantlab_report.json").read_text())["steps"] == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantization": quantlab.NF4Config(), "bitsandbytes": True}, "pass one of them"),
        ({"lora": LoraOptions(r=0)}, "--lora-r must be at least 1"),
    ],
)
def test_finetune_refuses_contradictory_options_before_any_work(llama_dir, tmp_path, options, message) -> None:
    with pytest.raises(FinetuneError, match=message):
        finetune(llama_dir, TrainingRun(tmp_path / "run", {"max_steps": 1}), **options)
    assert not (tmp_path / "run").exists()
