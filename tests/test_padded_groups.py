"""A group size that does not divide a layer's inputs is said in one warning, wherever quantizing starts."""

import warnings

import pytest
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.errors import PaddedGroupsWarning
from quantlab.testing import tiny_llama, tiny_llama_checkpoint


def _padded_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, PaddedGroupsWarning)]


def test_quantize_names_the_padded_layers_and_the_sizes_that_divide():
    with pytest.warns(PaddedGroupsWarning) as caught:
        quantlab.quantize(tiny_llama(0), quantlab.CustomBitsConfig(bits=4, group_size=128))
    (message,) = _padded_warnings(caught)
    assert message.startswith("custom_bits: model.layers.0.self_attn.q_proj and 13 more layer(s) pad their last")
    assert "64 inputs in groups of 128 store 128 codes a row (+100 %); groups of 32, 64 divide 64" in message
    down = {"model.layers.1.mlp.down_proj": {"group_size": 128}}  # 192 inputs
    with pytest.warns(PaddedGroupsWarning) as caught:
        quantlab.quantize(tiny_llama(0), quantlab.CustomBitsConfig(bits=4, group_size=32, layer_options=down))
    (message,) = _padded_warnings(caught)
    assert "model.layers.1.mlp.down_proj pad their last group: 192 inputs in groups of 128 store 256" in message
    assert message.endswith("(+33 %); groups of 32, 64 divide 192")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantlab.quantize(tiny_llama(0), quantlab.CustomBitsConfig(bits=4, group_size=32))
    assert not _padded_warnings(caught)


def test_loading_warns_when_it_quantizes_and_not_when_it_reloads(tmp_path):
    folder = tiny_llama_checkpoint(tmp_path / "float", 0)
    with pytest.warns(PaddedGroupsWarning):
        model = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=quantlab.LutConfig(bits=3, group_size=128)
        )
    model.save_pretrained(tmp_path / "lut")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AutoModelForCausalLM.from_pretrained(tmp_path / "lut")
    assert not _padded_warnings(caught)
