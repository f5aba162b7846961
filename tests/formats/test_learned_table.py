"""The lut codec: a table of 2**bits levels learned per layer, times a scale per group."""

import pytest
import torch
from torch import nn

import quantlab
from quantlab.formats import grouping, learned_table
from quantlab.formats.layout import StorageLayout
from quantlab.methods.lut import LutLinear
from quantlab.nn.fake_quant import FakeQuantizedWeight
from quantlab.solvers import InputStats, get_solver
from quantlab.testing.contract import sqnr
from quantlab.testing.lora import lora_step
from quantlab.testing.models import tiny_llama

IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 8, 4]])


def layout_of(bits: int, in_features: int = 128, out_features: int = 48, group_size: int | None = 32) -> StorageLayout:
    return StorageLayout("lut", bits, group_size, in_features, out_features, scale_dtype=torch.float16)


def heavy_tailed(out_features: int = 48, in_features: int = 128, seed: int = 0) -> torch.Tensor:
    """Student-t weights: the tails real layers have, which a normal-quantile table misplaces."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(out_features, in_features, generator=generator)
    chi = torch.randn(out_features, in_features, 3, generator=generator).square().sum(-1)
    return 0.02 * normal / (chi / 3).sqrt()


def weighted_error(layout: StorageLayout, weight: torch.Tensor, importance: torch.Tensor | None = None) -> float:
    stored = layout.quantize(weight)
    error = (layout.dequantize(stored) - weight).square()
    return float((error if importance is None else error * importance).sum())


def test_a_layout_takes_2_to_4_bits_and_a_sorted_table_from_minus_one_to_one():
    with pytest.raises(ValueError, match="2-4-bit codes"):
        layout_of(5)
    with pytest.raises(ValueError, match="4 sorted levels from -1 to 1"):
        StorageLayout.build("lut", 2, 32, 64, 8, table=(-1.0, 0.5, -0.5, 1.0))
    with pytest.raises(quantlab.ConfigError, match="bits=8 is not valid"):
        quantlab.LutConfig(bits=8)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_fitted_table_is_sorted_float16_with_its_ends_pinned(bits):
    table = layout_of(bits).prepare(heavy_tailed()).options.table
    assert len(table) == 1 << bits and list(table) == sorted(table)
    assert table[0] == -1.0 and table[-1] == 1.0
    assert torch.equal(torch.tensor(table).half().float(), torch.tensor(table))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_fitting_the_table_lowers_the_error_of_the_normal_quantile_start(bits):
    weight = heavy_tailed()
    start = StorageLayout.build(
        "lut", bits, 32, 128, 48, scale_dtype=torch.float16, table=learned_table.start_table(bits)
    )
    assert weighted_error(layout_of(bits).prepare(weight), weight) < 0.97 * weighted_error(start, weight)


def test_the_table_follows_the_inputs_that_matter():
    """Weighted by E[x^2], the table fits the busy channels' weights: less error there than a table fitted
    with every channel alike, whose weights here are spread differently from the busy ones'."""
    weight = heavy_tailed()
    weight[:, :32] = 0.02 * torch.rand(48, 32, generator=torch.Generator().manual_seed(1)).sub(0.5)  # uniform
    channels = torch.full((128,), 1e-3)
    channels[:32] = 1.0
    busy = layout_of(3).prepare(weight, channels)
    alike = layout_of(3).prepare(weight)
    assert busy.options.table != alike.options.table
    assert weighted_error(busy, weight, channels) < 0.95 * weighted_error(alike, weight, channels)


@pytest.mark.parametrize(("bits", "uniform_bits_per_weight"), [(2, 2.25), (3, 3.25), (4, 4.25)])
def test_more_accurate_than_symmetric_integers_at_the_same_size(bits, uniform_bits_per_weight):
    torch.manual_seed(0)
    linear = nn.Linear(512, 96)
    nn.init.normal_(linear.weight, std=0.02)
    lut = LutLinear.from_linear(linear, quantlab.LutConfig(bits=bits, group_size=64))
    uniform = quantlab.get_method("custom_bits").module_class.from_linear(
        linear, quantlab.CustomBitsConfig(bits=bits, group_size=64, symmetric=True)
    )
    assert uniform.layout.bits_per_weight() == uniform_bits_per_weight
    table_bits = 16 * (1 << bits)
    assert lut.stored_bytes() * 8 == uniform_bits_per_weight * linear.weight.numel() + table_bits
    weight = linear.weight.detach()
    assert sqnr(weight, lut.dequantize_weight()) > sqnr(weight, uniform.dequantize_weight()) + 0.3


def test_stored_tensors_decode_as_table_times_scale_and_bind_reads_the_table_back():
    weight = heavy_tailed()
    layout = layout_of(3)
    stored = layout.quantize(weight)
    assert stored["weight_table"].dtype == torch.float16 and stored["weight_table"].shape == (8,)
    bound = layout.bind(stored)
    assert bound.options.table == tuple(stored["weight_table"].float().tolist()) and layout.options.table is None
    codes, params = bound.load(stored)
    expected = stored["weight_table"].float()[codes.long()] * params.scale.unsqueeze(-1)
    assert torch.equal(layout.dequantize(stored), grouping.ungroup(expected, 128))
    with pytest.raises(ValueError, match="fit it first"):
        layout.store(codes, params)


def test_gptq_on_the_fitted_table_beats_round_to_nearest_on_the_layers_outputs():
    torch.manual_seed(0)
    mixing = torch.randn(128, 128) / 128**0.5 + torch.eye(128)
    inputs = torch.randn(2048, 128) @ mixing  # correlated inputs: where GPTQ's error feedback pays
    stats = InputStats(128)
    stats.add(inputs)
    weight = heavy_tailed()
    config = quantlab.LutConfig(bits=3, group_size=32, solver="gptq")
    gptq = LutLinear.quantize_checked(weight, config, "layer", stats)
    rtn = LutLinear.quantize_checked(weight, quantlab.LutConfig(bits=3, group_size=32), "layer")
    layout = LutLinear.layout_for(128, 48, config)
    output = inputs @ weight.T

    def output_error(stored):
        return float((inputs @ layout.dequantize(stored).T - output).square().mean())

    assert output_error(gptq) < 0.8 * output_error(rtn)
    assert get_solver("gptq").unsupported(layout) is None


def test_the_fake_quantizer_starts_from_the_layers_own_table():
    weight = heavy_tailed()
    layer = LutLinear.from_linear(nn.Linear(128, 48), quantlab.LutConfig(bits=3, group_size=32))
    layer.load_stored(layer.layout.quantize(weight))
    quantizer = FakeQuantizedWeight.from_solution(layer.layout, weight, layer.stored_tensors())
    assert torch.equal(quantizer(), layer.dequantize_weight())
    stored = quantizer.stored()
    assert all(torch.equal(stored[name], tensor) for name, tensor in layer.stored_tensors().items())


def test_a_lora_step_changes_only_the_adapters():
    kept, changed = lora_step(quantlab.quantize(tiny_llama(seed=5), quantlab.LutConfig(bits=3, group_size=32)), IDS)
    assert kept and changed and all("lora_" in name for name in changed)
