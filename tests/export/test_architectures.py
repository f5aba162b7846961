"""Every causal LM of the architecture matrix, 4-bit quantized, exports to ONNX and onnxruntime computes quantlab's
logits; the mixtures of experts with every expert's projections lowered from its own codes.

One export takes seconds (torch.export and the ONNX translation, not the model's size), so each architecture is
exported with as few blocks as show all its kinds of layer: one where all are alike, the matrix's two where they
differ (Gemma 2's sliding and full attention, DeepSeek-V3's dense first block).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

import quantlab
from quantlab.export import OnnxCausalLM, to_onnx
from quantlab.nn.quantized_experts import QuantizedExperts
from quantlab.testing.architectures import ARCHITECTURES, MIXTURES_OF_EXPERTS, tiny_config

CONFIG = quantlab.CustomBitsConfig(bits=4, group_size=32)


def _one_block_is_enough(config) -> bool:
    layer_types = getattr(config, "layer_types", None) or []
    return len(set(layer_types)) <= 1 and not getattr(config, "first_k_dense_replace", 0)


def _quantized(model_type: str) -> PreTrainedModel:
    """The matrix's tiny model of `model_type` (one block where its blocks are all alike), quantized."""
    config = tiny_config(model_type)
    if _one_block_is_enough(config):
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:1]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    return quantlab.quantize(model, CONFIG, progress=False)


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_onnxruntime_computes_quantlabs_logits(model_type: str, onnx_path, helpers) -> None:
    model = _quantized(model_type)
    result = to_onnx(model, onnx_path)
    assert set(result.layer_operators.values()) == {"MatMulNBits"}

    experts = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedExperts)}
    assert bool(experts) == (model_type in MIXTURES_OF_EXPERTS)
    stored = helpers.layer_initializer_bytes(onnx_path, model)
    for name, module in experts.items():  # each expert's codes, not float weights: ~the module's own bytes
        assert {result.layer_operators[f"{name}.{p}"] for p in ("gate_up_proj", "down_proj")} == {"MatMulNBits"}
        assert module.stored_bytes() <= stored[name] <= 1.5 * module.stored_bytes()

    ids, mask = helpers.padded_batch()
    assert helpers.max_logit_error(model, OnnxCausalLM(onnx_path)(ids, mask), ids, mask) <= 1e-3
