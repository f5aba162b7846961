"""An hqq model exports to ONNX through custom bits' lowering: nothing hqq-specific is needed."""

import pytest
import torch

import quantlab
from quantlab.testing import tiny_llama
from quantlab_hqq import HqqConfig

pytest.importorskip("onnxruntime", reason="needs quantlab[onnx]")


def test_onnx_export_matches_pytorch(tmp_path):
    from quantlab.export import OnnxCausalLM, to_onnx

    model = quantlab.quantize(tiny_llama(), HqqConfig(bits=4, group_size=32))
    export = to_onnx(model, tmp_path / "hqq.onnx")
    assert set(export.layer_operators.values()) == {"MatMulNBits"}, export.layer_operators
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens).logits
    torch.testing.assert_close(OnnxCausalLM(tmp_path / "hqq.onnx")(tokens), expected, rtol=1e-4, atol=1e-4)
