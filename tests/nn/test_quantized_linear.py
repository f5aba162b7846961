"""QuantizedLinear behaviours shared by every method."""

import pytest
import torch
from torch import nn

import quantlab


@pytest.mark.parametrize("cast", ["half", "bfloat16"])
def test_dtype_casts_leave_stored_tensors_untouched(cast):
    model = nn.Sequential(nn.Linear(64, 64))
    quantlab.quantize(model, quantlab.NF4Config())
    before = {name: tensor.clone() for name, tensor in model[0].stored_tensors().items()}
    getattr(model, cast)()
    after = model[0].stored_tensors()
    assert all(torch.equal(before[name], after[name]) and before[name].dtype == after[name].dtype for name in before)
    assert model[0].bias.dtype == (torch.float16 if cast == "half" else torch.bfloat16)


def test_stored_bytes_counts_every_stored_tensor():
    layer = quantlab.quantize(nn.Linear(256, 128), quantlab.CustomBitsConfig(bits=3, group_size=64))
    # 3 bits per weight, plus a float16 scale and zero point per group of 64.
    assert layer.stored_bytes() == 128 * 256 * 3 // 8 + 2 * 2 * 128 * 4


def test_to_linear_matches_dequantized_weight():
    layer = quantlab.quantize(nn.Linear(96, 40), quantlab.Int8SymmetricConfig(group_size=32))
    linear = layer.to_linear()
    assert type(linear) is nn.Linear
    assert torch.equal(linear.weight, layer.dequantize_weight())
    x = torch.randn(5, 96)
    torch.testing.assert_close(linear(x), layer(x))
