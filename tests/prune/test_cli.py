"""`quantlab prune` end to end on tiny checkpoints, in process: outputs that reload, and every bad input."""

import json
import re

import pytest
from transformers import AutoModelForCausalLM

from quantlab.cli.main import main
from quantlab.prune import load_sparse, masked_layers
from quantlab.prune.mask_rules import follows_nm

TRAIN = ["--max-seq-length", "32", "--batch-size", "2", "--learning-rate", "1e-3"]
EVAL = ["--eval-seq-len", "64", "--eval-windows", "2"]


def _run(capsys, *argv: str) -> tuple[int, dict | None, str]:
    code = main([*argv])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    report = json.loads(lines[-1]) if code == 0 and "--json" in argv else None
    return code, report, captured.err


def test_two_four_checkpoint_is_compact_and_reloads_with_its_masks(tmp_path, capsys, make_checkpoint):
    source = make_checkpoint(tmp_path / "tiny")
    argv = ["prune", str(source), "--pattern", "2:4", "--output-dir", str(tmp_path / "out"), "--json"]
    code, report, _ = _run(capsys, *argv)
    assert code == 0
    assert report["achieved_sparsity"] == pytest.approx(0.5)
    assert report["linear_weights_stored_ratio"] <= 0.6
    assert report["size_after_bytes"] < report["size_before_bytes"]
    model = load_sparse(tmp_path / "out" / "final")
    assert len(masked_layers(model)) == 14
    assert all(follows_nm(layer.weight != 0, 2, 4) for layer in masked_layers(model).values())
    assert (tmp_path / "out" / "quantlab_report.json").is_file()


def test_structured_checkpoint_is_a_smaller_ordinary_model(tmp_path, capsys, make_checkpoint):
    source = make_checkpoint(tmp_path / "tiny")
    argv = ["prune", str(source), "--pattern", "structured", "--sparsity", "0.25", "--head-sparsity", "0.5"]
    code, report, _ = _run(capsys, *argv, "--calibration-samples", "2", "--output-dir", str(tmp_path / "out"), "--json")
    assert code == 0
    assert report["parameters_after"] < report["parameters_before"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final")
    assert (model.config.intermediate_size, model.config.num_attention_heads) == (144, 2)


def test_recovery_by_distillation_keeps_the_sparsity(tmp_path, capsys, make_checkpoint):
    source = make_checkpoint(tmp_path / "tiny")
    argv = ["prune", str(source), "--pattern", "unstructured", "--sparsity", "0.5", "--max-steps", "2"]
    argv += ["--distill-from", str(source), *TRAIN, "--eval", *EVAL, "--output-dir", str(tmp_path / "out"), "--json"]
    code, report, _ = _run(capsys, *argv)
    assert code == 0
    assert report["teacher"] == str(source) and report["finetune_steps"] == 2
    assert report["perplexity_after"] is not None
    model = load_sparse(tmp_path / "out" / "final")
    for layer in masked_layers(model).values():
        assert float((layer.weight == 0).float().mean()) == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--pattern", "unstructured", "--sparsity", "1.0"], r"in \[0, 1\)"),
        (["--pattern", "unstructured", "--sparsity", "-0.2"], r"in \[0, 1\)"),
        (["--pattern", "unstructured"], "needs a sparsity"),
        (["--pattern", "2:4", "--sparsity", "0.7"], "sparsity 0.5"),
        (["--pattern", "1:3"], "3 does not divide"),
        (["--pattern", "blocks"], "not valid"),
        (["--pattern", "structured"], "--sparsity"),
        (["--pattern", "2:4", "--distill-from", "x"], "--max-steps"),
        (["--pattern", "2:4", "--head-sparsity", "0.5"], "structured only"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, make_checkpoint, arguments, message):
    source = make_checkpoint(tmp_path / "tiny")
    code, _, err = _run(capsys, "prune", str(source), *arguments, "--output-dir", str(tmp_path / "out"))
    assert code == 2
    last = err.strip().splitlines()[-1]  # notes on the progress may come before the error line
    assert last.startswith("quantlab: error:") and "Traceback" not in err
    assert re.search(message, last), err
    assert not (tmp_path / "out").exists()
