"""Grid-trained layers: the stored weight at the start, exact gradients to the grids and learned tables, codes kept
when written back."""

import pytest
import torch
from torch.nn import functional as F

import quantlab
from quantlab.formats import grouping
from quantlab.nn import QuantizedLinear
from quantlab.nn.grid_trained import GridTrainedLinear, TrainedGrid

CONFIGS = {
    "3-bit g32 symmetric": lambda: quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True),
    "4-bit g32 with zero points": lambda: quantlab.CustomBitsConfig(bits=4, group_size=32),
    "4-bit g32 on 80 inputs (a padded last group)": lambda: quantlab.CustomBitsConfig(bits=4, group_size=32),
    "nf4 b32 double quant": lambda: quantlab.NF4Config(blocksize=32),
    "int8 per channel": lambda: quantlab.Int8SymmetricConfig(),
    "iq4_nl": lambda: quantlab.IQ4NLConfig(),
    "lut 3-bit g32": lambda: quantlab.LutConfig(bits=3, group_size=32),
}


def _quantized_layer(name: str) -> QuantizedLinear:
    torch.manual_seed(0)
    in_features = 80 if "80 inputs" in name else 64
    model = torch.nn.Sequential(torch.nn.Linear(in_features, 48))
    quantized = quantlab.quantize(model, CONFIGS[name]())
    return quantized[0]


def _grid_layer(layer: QuantizedLinear) -> GridTrainedLinear:
    return GridTrainedLinear(TrainedGrid.from_stored(layer.layout, layer.stored_tensors()), layer.bias)


def _move_table(grid: TrainedGrid) -> None:
    """Move a learned table's interior levels as a step would (nothing for formats without one)."""
    if grid.table is not None:
        with torch.no_grad():
            grid.table.add_(torch.empty_like(grid.table).uniform_(-0.02, 0.02))
        grid.project()


def _levels(grid: TrainedGrid) -> torch.Tensor:
    """The table's levels as computed (rounded as stored), with the gradient of the unrounded interior."""
    rounded = grid.current_layout().levels()
    full = torch.cat([rounded[:1], grid.table, rounded[-1:]])
    return full + (rounded - full).detach()


@pytest.mark.parametrize("name", CONFIGS)
def test_starts_at_the_stored_weight_and_its_gradients_are_the_dense_ones(name):
    layer = _quantized_layer(name)
    trained = _grid_layer(layer)
    grid = trained.weight_quantizer
    x = torch.randn(3, 5, layer.in_features)
    with torch.no_grad():
        assert torch.equal(trained(x), F.linear(x, layer.dequantize_weight(), layer.bias))
        assert torch.equal(grid.weight(), layer.dequantize_weight())
    with torch.no_grad():  # move the grids off their start, as a step would
        grid.scale_ratio.uniform_(0.9, 1.1)
        if grid.zero is not None:
            grid.zero.add_(torch.rand_like(grid.zero))
    _move_table(grid)
    x.requires_grad_(True)
    out = trained(x)
    target = torch.randn_like(out)
    (out * target).sum().backward()
    got = {"x": x.grad.clone(), "scale": grid.scale_ratio.grad.clone()}
    got_zero = None if grid.zero is None else grid.zero.grad.clone()
    got_table = None if grid.table is None else grid.table.grad.clone()
    # The same weight written out densely, differentiated by autograd (straight through the stored rounding).
    x.grad = None
    grid.scale_ratio.grad = None
    if grid.zero is not None:
        grid.zero.grad = None
    if grid.table is not None:
        grid.table.grad = None
    scale, zero = grid.learned()
    unit = grid.levels_minus_zero(zero) if grid.table is None else torch.take(_levels(grid), grid.codes.long())
    weight = grouping.ungroup(unit * scale.unsqueeze(-1), layer.in_features)
    dense = F.linear(x, weight, layer.bias)
    assert torch.allclose(dense, out, rtol=1e-6, atol=1e-6)
    (dense * target).sum().backward()
    assert torch.allclose(got["x"], x.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got["scale"], grid.scale_ratio.grad, rtol=1e-4, atol=1e-5)
    if got_zero is not None:
        assert torch.allclose(got_zero, grid.zero.grad, rtol=1e-4, atol=1e-5)
        assert got_zero.abs().sum() > 0
    if got_table is not None:
        assert torch.allclose(got_table, grid.table.grad, rtol=1e-4, atol=1e-5)
        assert torch.all(got_table != 0)


@pytest.mark.parametrize("name", CONFIGS)
def test_written_back_the_codes_are_unchanged_and_the_weight_is_what_training_computed(name):
    layer = _quantized_layer(name)
    codes_before = layer.layout.bind(layer.stored_tensors()).load(layer.stored_tensors())[0]
    trained = _grid_layer(layer)
    grid = trained.weight_quantizer
    with torch.no_grad():
        grid.scale_ratio.uniform_(0.7, 1.3)
        grid.project()
        if grid.zero is not None:
            grid.zero.add_(0.25)
    _move_table(grid)
    computed = grid.weight()
    layer.load_stored(grid.stored())
    assert torch.equal(layer.dequantize_weight(), computed)
    codes_after = layer.layout.bind(layer.stored_tensors()).load(layer.stored_tensors())[0]
    assert torch.equal(codes_after, codes_before)
    assert not torch.equal(computed, _grid_layer(_quantized_layer(name)).weight_quantizer.weight())


def test_scales_are_kept_in_range():
    grid = _grid_layer(_quantized_layer("3-bit g32 symmetric")).weight_quantizer
    with torch.no_grad():
        grid.scale_ratio.fill_(3.0)
    grid.project()
    assert torch.all(grid.scale_ratio == 1.5)


def test_a_learned_tables_levels_stay_sorted_between_its_ends():
    grid = _grid_layer(_quantized_layer("lut 3-bit g32")).weight_quantizer
    assert grid.table.numel() == 6 and grid.table.requires_grad
    with torch.no_grad():
        grid.table.copy_(torch.tensor([-1.4, 0.3, 0.1, 0.2, 0.9, 1.2]))
    grid.project()
    assert grid.table.tolist() == pytest.approx([-1.0, 0.3, 0.3, 0.3, 0.9, 1.0])
    assert grid.current_layout().learned_table[::7] == (-1.0, 1.0)
    assert _grid_layer(_quantized_layer("4-bit g32 with zero points")).weight_quantizer.table is None
