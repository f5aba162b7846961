"""`int8_activations=True` in the model's eager forwards (a prompt's prefill): every eligible layer rounds its
inputs to int8 blocks of 64 and multiplies them in integers, as the compiled step does; the rest stays float."""

import pytest
import torch

import quantlab
from quantlab.generation import disable_compiled_decoding, fast_decoding_config
from quantlab.kernels.cpu import native, ops
from quantlab.nn import QuantizedLinear
from quantlab.testing.models import tiny_llama

pytestmark = pytest.mark.skipif(
    not ops.available() or not native.int8_activations_supported(),
    reason="needs quantlab's torch operators and a CPU with an int8-activation kernel (AVX2 or AVX512-VNNI)",
)


def _rounded_per_block(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """x as the int8 kernels see it: each row's blocks of 64 inputs scaled to +-127 by their largest
    magnitude, rounded to the nearest integer (ties to even), scaled back."""
    blocks = x.reshape(x.shape[0], -1, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(blocks / scale.clamp_min(torch.finfo(x.dtype).tiny)), 0)
    return (codes * scale).reshape(x.shape)


def _layers(model) -> dict[str, QuantizedLinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}


@pytest.mark.parametrize("rows", [1, 5, 48, 257])
@pytest.mark.parametrize(
    "config", [quantlab.CustomBitsConfig(bits=4, group_size=64), quantlab.Int8SymmetricConfig()], ids=["4bit", "int8"]
)
def test_an_eager_layer_multiplies_int8_rounded_inputs(config, rows):
    layer = quantlab.get_method(config.method).module_class.from_linear(torch.nn.Linear(192, 80, bias=True), config)
    x = torch.randn(rows, 192)
    expected = _rounded_per_block(x) @ layer.dequantize_weight(torch.float32).T + layer.bias
    float_out = layer(x)
    layer.activation_bits = 8
    with torch.no_grad():
        out = layer(x)
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    assert not torch.equal(out, float_out)


def test_a_layer_that_needs_gradients_keeps_float_inputs():
    config = quantlab.CustomBitsConfig(bits=4, group_size=64)
    layer = quantlab.get_method(config.method).module_class.from_linear(torch.nn.Linear(128, 64), config)
    x = torch.randn(9, 128, requires_grad=True)
    float_out = layer(x)
    layer.activation_bits = 8
    out = layer(x)
    assert torch.equal(out, float_out)
    out.sum().backward()
    assert x.grad is not None


def test_fast_decoding_config_marks_the_eligible_layers_and_disabling_unmarks_them():
    model = tiny_llama(seed=3)  # Linear inputs of 64, 128 and 96: groups of 32 are not int8-ready
    quantlab.quantize(model, quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    fast_decoding_config(model, max_cache_len=64, int8_activations=True)
    assert {layer.activation_bits for layer in _layers(model).values()} == {0}

    model = quantlab.quantize(tiny_llama(seed=3), quantlab.Int8SymmetricConfig())  # a group per row: every layer
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        float_logits = model(prompt).logits
        fast_decoding_config(model, max_cache_len=64, int8_activations=True)
        assert {layer.activation_bits for layer in _layers(model).values()} == {8}
        int8_logits = model(prompt).logits
        disable_compiled_decoding(model)
        assert {layer.activation_bits for layer in _layers(model).values()} == {0}
        assert torch.equal(model(prompt).logits, float_logits)
    relative = ((int8_logits - float_logits).norm() / float_logits.norm()).item()
    assert 0 < relative < 0.05
