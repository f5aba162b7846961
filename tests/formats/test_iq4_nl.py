"""The iq4_nl codec: llama.cpp's IQ4_NL table times a float16 scale per group."""

import pytest
import torch

from quantlab.formats import grouping, iq4_nl
from quantlab.formats.layout import StorageLayout
from quantlab.solvers import InputStats, get_solver


def layout_of(in_features: int, out_features: int, group_size: int = 32) -> StorageLayout:
    return StorageLayout("iq4_nl", 4, group_size, in_features, out_features, scale_dtype=torch.float16)


def brute_force_codes(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Index of the level nearest to each `value / scale` by trying all 16 (the first of a tie); a zero
    scale (a group of zeros, or one too small for float16) puts every weight on the level nearest 0."""
    table = iq4_nl.levels()
    target = torch.where(scale == 0, 0.0, values / scale)
    return (target.unsqueeze(-1) - table).abs().argmin(dim=-1).to(torch.uint8)


def squared_error(layout: StorageLayout, weight: torch.Tensor, stored: dict) -> torch.Tensor:
    """Per group `[out, groups]`."""
    difference = layout.dequantize(stored) - weight
    return grouping.group(difference, layout.group_size).square().sum(dim=-1)


def test_the_table_is_llama_cpps():
    gguf = pytest.importorskip("gguf")
    assert gguf.quants.IQ4_NL.kvalues == iq4_nl.KVALUES


def test_a_layout_needs_4_bits_and_float16_scales():
    with pytest.raises(ValueError, match="iq4_nl codec stores 4-bit codes"):
        StorageLayout("iq4_nl", 3, 32, 64, 8, scale_dtype=torch.float16)
    with pytest.raises(ValueError, match="float16 scales"):
        StorageLayout("iq4_nl", 4, 32, 64, 8)


def test_store_then_load_gives_back_codes_and_grids(helpers):
    layout = layout_of(100, 8)
    grouped = grouping.group(helpers.tricky_weights(8, 100), 32)
    fitted, _ = helpers.assert_store_load_round_trip(layout, grouped)
    assert torch.equal(fitted.scale, fitted.scale.half().float())  # codes were chosen against float16 scales


@pytest.mark.parametrize("signed", [False, True])
def test_codes_are_the_nearest_level_for_the_stored_scale(signed, helpers):
    layout = layout_of(256, 16)
    grouped = grouping.group(helpers.tricky_weights(16, 256, seed=1), 32)
    for ratio in (1.0, 0.9, 1.07):
        params = layout.fit(grouped, ratio, signed=signed)
        codes = layout.quantize_grouped(grouped, params)
        assert torch.equal(codes, brute_force_codes(grouped, params.scale.unsqueeze(-1)))


def test_the_signed_fit_puts_each_groups_extreme_on_the_lowest_level():
    layout = layout_of(32, 2)
    weight = torch.linspace(-0.5, 1.0, 32).repeat(2, 1)
    weight[1] = -weight[1]
    params = layout.fit(grouping.group(weight, 32), signed=True)
    codes = layout.quantize_grouped(grouping.group(weight, 32), params)
    assert codes[:, 0, -1].tolist() == [0, 0]  # +1.0 (row 0) and -1.0 (row 1) on level -127
    assert params.scale[0, 0] < 0 < params.scale[1, 0]


def test_round_to_nearest_stores_the_nearest_codes_and_never_loses_to_the_plain_fit(helpers):
    weight = helpers.tricky_weights(24, 320, seed=2)
    layout = layout_of(320, 24)
    stored = layout.quantize(weight)
    helpers.assert_matches_specs(layout, stored)
    codes, params = layout.load(stored)
    grouped = grouping.group(weight, 32)
    assert torch.equal(codes, brute_force_codes(grouped, params.scale.unsqueeze(-1)))
    plain = layout.fit(grouped)
    plain_stored = layout.store(layout.quantize_grouped(grouped, plain), plain)
    searched, fitted = squared_error(layout, weight, stored), squared_error(layout, weight, plain_stored)
    assert (searched <= fitted).all()
    assert searched.sum() < 0.95 * fitted.sum()


def test_round_to_nearest_gives_a_group_of_zeros_a_zero_scale_and_zeros_back():
    layout = layout_of(64, 2)
    weight = torch.zeros(2, 64)
    weight[1, 32:] = 0.25
    stored = layout.quantize(weight)
    assert stored["weight_scale"][0].tolist() == [0.0, 0.0]
    assert torch.equal(layout.dequantize(stored)[0], torch.zeros(64))


def test_the_signal_to_noise_ratio_is_that_of_a_4_bit_grid():
    torch.manual_seed(0)
    weight = torch.randn(64, 512) * 0.02
    layout = layout_of(512, 64)
    noise = (layout.dequantize(layout.quantize(weight)) - weight).square().sum()
    assert 10 * torch.log10(weight.square().sum() / noise) > 19.0


def test_gptq_lowers_the_output_error_of_round_to_nearest_on_correlated_inputs():
    torch.manual_seed(0)
    in_features, out_features = 128, 48
    mixing = torch.randn(in_features, in_features) / in_features**0.5 + torch.eye(in_features)
    inputs = torch.randn(2048, in_features) @ mixing * torch.linspace(0.2, 3.0, in_features)
    weight = torch.randn(out_features, in_features) * 0.05
    stats = InputStats(in_features)
    stats.add(inputs)
    layout = layout_of(in_features, out_features)
    rtn = layout.dequantize(layout.quantize(weight))
    solution = get_solver("gptq").solve(weight, layout, stats, {})
    gptq = layout.dequantize(layout.store(solution.codes, solution.params))

    def output_error(quantized: torch.Tensor) -> float:
        return (inputs @ (quantized - weight).T).square().mean().item()

    assert output_error(gptq) < 0.8 * output_error(rtn)


def test_native_decoding_equals_the_reference(library, helpers):
    from quantlab import IQ4NLConfig, get_method
    from quantlab.kernels.cpu.linear import native_dequantize
    from quantlab.kernels.cpu.weights import native_weight

    linear = torch.nn.Linear(200, 37)
    linear.weight.data = helpers.tricky_weights(37, 200, seed=3)
    layer = get_method("iq4_nl").module_class.from_linear(linear, IQ4NLConfig())
    assert layer.weight_scale.dtype == torch.float16
    assert torch.equal(native_dequantize(native_weight(layer)), layer.dequantize_weight(torch.float32))
