"""The storage layout: one description of each format, read by solvers, kernels and checks."""

import pytest
import torch

import quantlab
from quantlab.formats import grouping
from quantlab.formats.layout import StorageLayout
from quantlab.registry import get_method

CONFIGS = [
    quantlab.Int8SymmetricConfig(),
    quantlab.Int8SymmetricConfig(group_size=64),
    quantlab.NF4Config(),
    quantlab.NF4Config(double_quant=False),
    quantlab.CustomBitsConfig(bits=3, group_size=64),
    quantlab.CustomBitsConfig(bits=4, group_size=128, symmetric=True),
    quantlab.CustomBitsConfig(bits=8, group_size=None),
]


@pytest.mark.parametrize("config", CONFIGS, ids=repr)
def test_store_then_load_gives_back_codes_and_grids(config):
    layer_class = get_method(config.method).module_class
    layout = layer_class.layout_for(300, 48, config)
    torch.manual_seed(0)
    grouped = grouping.group(torch.randn(48, 300) * 0.02, layout.group_size)
    params = layout.fit(grouped)
    codes = layout.quantize_grouped(grouped, params)
    stored = layout.store(codes, params)
    assert {name: (tuple(t.shape), t.dtype) for name, t in stored.items()} == {
        name: (spec.shape, spec.dtype) for name, spec in layout.tensors.items()
    }
    loaded_codes, loaded = layout.load(stored)
    assert torch.equal(loaded_codes[..., : codes.shape[-1]], codes)
    assert torch.equal(loaded.scale, params.scale)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.method != "nf4" or not c.double_quant], ids=repr)
def test_layout_rounding_equals_the_methods_round_to_nearest(config):
    """Solvers start from the same grid as the built-in (native) round-to-nearest path."""
    layer_class = get_method(config.method).module_class
    torch.manual_seed(1)
    weight = torch.randn(64, 320) * 0.05
    layout = layer_class.layout_for(320, 64, config)
    grouped = grouping.group(weight, layout.group_size)
    params = layout.fit(grouped)
    ours = layout.store(layout.quantize_grouped(grouped, params), params)
    theirs = layer_class.quantize_weight(weight, config)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def test_bits_per_weight_of_nf4_with_double_quant_is_qloras():
    layout = StorageLayout.build("nf4", 4, 64, 4096, 4096, double_quant=True)
    assert layout.bits_per_weight() == pytest.approx(4.127, abs=1e-3)


def test_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="codec"):
        StorageLayout("fp4", 4, 64, 64, 64)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_signed_grid_sends_each_groups_extreme_to_the_lowest_code(bits):
    """Symmetric codes have one more negative level than positive: a negative scale lets a
    group whose extreme weight is positive use it, so every group gets all 2**bits levels."""
    layout = StorageLayout.build("affine", bits, 32, 64, 8, symmetric=True, scale_dtype=torch.float16)
    torch.manual_seed(2)
    weight = torch.randn(8, 64)
    grouped = grouping.group(weight, 32)
    params = layout.fit(grouped, signed=True)
    codes = layout.quantize_grouped(grouped, params)
    extreme = grouped.abs().argmax(dim=-1, keepdim=True)
    assert (codes.gather(-1, extreme) == 0).all()
    assert torch.equal(params.scale < 0, grouped.gather(-1, extreme).squeeze(-1) > 0)
    if bits == 8:
        return  # 256 against 255 levels: the gain is within rounding noise
    values = layout.decode(codes, params.scale.unsqueeze(-1), None)
    unsigned = layout.fit(grouped)
    rounded = layout.decode(layout.quantize_grouped(grouped, unsigned), unsigned.scale.unsqueeze(-1), None)
    assert (values - grouped).square().mean() < (rounded - grouped).square().mean()


def test_negative_scales_run_through_the_kernels_save_and_reload(tmp_path):
    """A layer whose grids the search made signed computes with its dequantized weight, on the
    native kernels as on the reference ones, and reloads with the same stored tensors."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(3)
    linear = torch.nn.Linear(256, 96)
    config = quantlab.CustomBitsConfig(bits=3, group_size=64, symmetric=True, solver="mse")
    layer = quantlab.quantize(linear, config)
    assert (layer.weight_scale < 0).any() and (layer.weight_scale > 0).any()
    weight = layer.layout.dequantize({name: getattr(layer, name) for name in layer.layout.tensors})
    for rows in (1, 5, 130):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(layer(x), x @ weight.T + linear.bias, rtol=1e-4, atol=1e-4)
    save_file({name: getattr(layer, name) for name in layer.layout.tensors}, tmp_path / "layer.safetensors")
    reloaded = load_file(tmp_path / "layer.safetensors")
    assert torch.equal(reloaded["weight_scale"], layer.weight_scale)
