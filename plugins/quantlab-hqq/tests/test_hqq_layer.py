"""`HqqLinear` and `HqqConfig`: custom-bits storage filled by the optimiser."""

import pytest
import torch
from torch import nn

from quantlab import CustomBitsConfig
from quantlab.errors import ConfigError
from quantlab.kernels import select_kernel
from quantlab.methods.custom_bits import CustomBitsLinear
from quantlab_hqq import HqqConfig, HqqLinear, method


def heavy_tailed(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    """Student-t with 3 degrees of freedom: the outliers of real LLM weights."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, columns, generator=generator)
    chi2 = torch.randn(rows, columns, 3, generator=generator).square().sum(-1)
    return normal / (chi2 / 3).sqrt() * 0.02


@pytest.mark.parametrize(("bits", "group_size"), [(2, 32), (3, 64), (4, 128), (8, None)])
def test_stores_exactly_what_custom_bits_stores(bits, group_size):
    """Same format, same tensors, same size: custom bits' kernels and exports apply unchanged."""
    linear = nn.Linear(200, 24)
    hqq = HqqLinear.from_linear(linear, HqqConfig(bits=bits, group_size=group_size))
    rtn = CustomBitsLinear.from_linear(linear, CustomBitsConfig(bits=bits, group_size=group_size))
    assert hqq.format == rtn.format
    assert select_kernel(hqq.format, "cpu") is select_kernel(rtn.format, "cpu")
    assert {k: (v.shape, v.dtype) for k, v in hqq.stored_tensors().items()} == {
        k: (v.shape, v.dtype) for k, v in rtn.stored_tensors().items()
    }
    x = torch.randn(5, 200)
    torch.testing.assert_close(hqq(x), x @ hqq.dequantize_weight().T + hqq.bias, rtol=1e-4, atol=1e-5)


def test_constant_and_tiny_groups_stay_exact_and_finite():
    weight = torch.zeros(4, 128)
    weight[1] = 0.25
    weight[2, :64] = -1.0
    weight[3] = torch.linspace(0, 1e-9, 128)  # its fp16 scale underflows to zero
    layer = HqqLinear.from_linear(torch.nn.Linear(128, 4), HqqConfig(bits=4, group_size=64))
    layer.load_stored(HqqLinear.quantize_weight(weight, layer.config))
    restored = layer.dequantize_weight()
    assert torch.isfinite(restored).all()
    torch.testing.assert_close(restored[:3], weight[:3], rtol=0, atol=1e-3)
    assert restored[3].abs().max() < 1e-8


def test_row_chunks_do_not_change_the_result(monkeypatch):
    weight = heavy_tailed(40, 192)
    config = HqqConfig(bits=3, group_size=64)
    whole = HqqLinear.quantize_weight(weight, config)
    monkeypatch.setattr(method, "MAX_WEIGHTS_PER_CHUNK", 7 * 192)
    chunked = HqqLinear.quantize_weight(weight, config)
    assert all(torch.equal(whole[name], chunked[name]) for name in whole)


def test_layer_beats_custom_bits_round_to_nearest():
    linear = torch.nn.Linear(1024, 256)
    linear.weight.data = heavy_tailed(256, 1024)
    hqq = HqqLinear.from_linear(linear, HqqConfig(bits=4, group_size=64)).dequantize_weight()
    rtn = CustomBitsLinear.from_linear(linear, CustomBitsConfig(bits=4, group_size=64)).dequantize_weight()
    squared_error = lambda approx: (linear.weight.detach() - approx).square().sum()  # noqa: E731
    assert squared_error(hqq) < 0.95 * squared_error(rtn)


@pytest.mark.parametrize(
    "options",
    [{"lp_norm": 0.0}, {"lp_norm": 1.5}, {"iterations": -1}, {"beta": 0}, {"kappa": 0.5}, {"optimize_scale": "yes"}],
    ids=str,
)
def test_bad_options_are_refused(options):
    with pytest.raises(ConfigError, match=next(iter(options))):
        HqqConfig(**options)


def test_symmetric_is_not_an_option():
    assert "symmetric" not in HqqConfig.option_names()
    with pytest.raises(ConfigError, match="symmetric"):
        HqqConfig.from_options({"symmetric": True})
