"""Encoders (BERT) export with every output tensor and match PyTorch, float and quantized."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

import quantlab
from quantlab.export import to_onnx
from quantlab.testing import tiny_bert

CONFIGS = [quantlab.Int8SymmetricConfig(), quantlab.NF4Config(), quantlab.CustomBitsConfig(bits=3)]


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8-nf4-cb3"])
def test_bert_outputs_match_pytorch(quantized, onnx_path) -> None:
    model = tiny_bert()
    if quantized:  # one method after the other over the Linear layers (biases included)
        names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
        for index, name in enumerate(names):
            quantlab.quantize(model, CONFIGS[index % len(CONFIGS)], modules=[name])
    result = to_onnx(model, onnx_path)
    if quantized:
        assert sorted(set(result.layer_operators.values())) == ["MatMulBnb4", "MatMulNBits", "fallback"]
        assert len(result.layer_operators) == 13
    assert result.kind == "encoder"
    assert result.input_names == ["input_ids", "attention_mask", "token_type_ids"]
    assert result.output_names == ["last_hidden_state", "pooler_output"]

    ids = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # right padding, as tokenizers pad encoders
    types = torch.zeros_like(ids)
    types[:, 5:] = 1
    session = ort.InferenceSession(onnx_path)
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": types.numpy()}
    hidden, pooled = session.run(None, feed)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert np.abs(hidden - reference.last_hidden_state.numpy())[mask.bool().numpy()].max() <= 1e-3
    assert np.abs(pooled - reference.pooler_output.numpy()).max() <= 1e-3
