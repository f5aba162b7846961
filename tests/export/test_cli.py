"""`quantlab export onnx` end to end on tiny checkpoints, in process."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.cli.main import main
from quantlab.export import OnnxCausalLM
from quantlab.testing import tiny_llama, tiny_model_dir


def _run(capsys, *argv) -> tuple[int, dict | None, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    report = json.loads(lines[-1]) if code == 0 and "--json" in argv else None
    return code, report, captured.out, captured.err


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return tiny_model_dir(tiny_llama(), tmp_path_factory.mktemp("float") / "tiny")


@pytest.fixture(scope="module")
def nf4_dir(tmp_path_factory):
    model = quantlab.quantize(tiny_llama(), quantlab.NF4Config())
    return tiny_model_dir(model, tmp_path_factory.mktemp("nf4") / "tiny-nf4")


def test_quantized_checkpoint_exports_with_past(capsys, nf4_dir, tmp_path) -> None:
    output = tmp_path / "out" / "tiny.onnx"
    code, report, _, _ = _run(capsys, "export", "onnx", nf4_dir, "--output", output, "--with-past", "--json")
    assert code == 0
    assert report["command"] == "export onnx"
    assert report["kind"] == "causal-lm" and report["with_past"] is True
    assert report["quantized_layers"] == {"MatMulBnb4": 14}
    assert report["operators"]["com.microsoft::MatMulBnb4"] == 14
    assert report["bytes"] == output.stat().st_size
    reloaded = AutoModelForCausalLM.from_pretrained(nf4_dir)
    prompt = torch.tensor([[7, 8, 9]])
    with torch.no_grad():
        expected = reloaded.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
    assert torch.equal(OnnxCausalLM(output).generate(prompt, max_new_tokens=10), expected)


def test_report_table_without_json(capsys, nf4_dir, tmp_path) -> None:
    code, _, out, _ = _run(capsys, "export", "onnx", nf4_dir, "--output", tmp_path / "tiny.onnx", "--quiet")
    assert code == 0
    assert "quantized layers" in out and "14 MatMulBnb4" in out


def test_ort_dynamic_int8_of_a_float_checkpoint(capsys, float_dir, tmp_path) -> None:
    output = tmp_path / "int8.onnx"
    code, report, _, _ = _run(capsys, "export", "onnx", float_dir, "--output", output, "--ort-dynamic-int8", "--json")
    assert code == 0
    assert report["ort_dynamic_int8"] is True
    assert report["operators"].get("MatMulInteger", 0) >= 14
    assert report["quantized_layers"] == {}
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(float_dir)(ids).logits.numpy().ravel()
    approx = OnnxCausalLM(output)(ids).numpy().ravel()
    cosine = approx @ reference / (np.linalg.norm(approx) * np.linalg.norm(reference))
    assert cosine > 0.99  # re-quantized weights and activations: close, not equal


def test_existing_output_is_a_one_line_error(capsys, float_dir, tmp_path) -> None:
    output = tmp_path / "taken.onnx"
    output.write_bytes(b"keep me")
    code, _, _, err = _run(capsys, "export", "onnx", float_dir, "--output", output)
    assert code == 2
    assert err.strip().splitlines() == [
        f"quantlab: error: output {output} already exists; pass --overwrite (overwrite=True) or pick another"
    ]
    assert output.read_bytes() == b"keep me"


def test_missing_model_is_a_one_line_error(capsys, tmp_path) -> None:
    code, _, _, err = _run(capsys, "export", "onnx", tmp_path / "nowhere", "--output", tmp_path / "x.onnx")
    assert code == 2
    assert "does not exist" in err and len(err.strip().splitlines()) == 1


def test_quantized_checkpoint_with_dynamic_int8_is_a_one_line_error(capsys, nf4_dir, tmp_path) -> None:
    code, _, _, err = _run(capsys, "export", "onnx", nf4_dir, "--output", tmp_path / "x.onnx", "--ort-dynamic-int8")
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("quantlab: error: model.layers.0.self_attn.q_proj: ort_dynamic_int8")
    assert "already quantized by quantlab" in last and "Traceback" not in err
