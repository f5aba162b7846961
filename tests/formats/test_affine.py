"""The affine codec: 1-8 bit integer codes with and without zero points."""

import pytest
import torch

from quantlab.formats import grouping
from quantlab.formats.layout import StorageLayout

SCALE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def layout_of(bits: int, symmetric: bool, group_size: int | None = 64, scale_dtype=torch.float32, shape=(16, 200)):
    return StorageLayout.build(
        "affine", bits, group_size, shape[1], shape[0], symmetric=symmetric, scale_dtype=scale_dtype
    )


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [False, True])
def test_error_is_at_most_half_a_step(bits, symmetric):
    torch.manual_seed(bits)
    weight = torch.randn(16, 200)
    layout = layout_of(bits, symmetric)
    stored = layout.quantize(weight)
    restored = layout.dequantize(stored)
    step = grouping.ungroup(stored["weight_scale"].unsqueeze(-1).expand(-1, -1, 64), 200)
    # Symmetric grids clamp nothing (absmax maps to the top code); the bound is half a step.
    assert ((restored - weight).abs() <= step / 2 + 1e-6).all()
    assert int(layout.codes(stored["weight"]).max()) < 2**bits


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_store_then_load_gives_back_codes_and_grids(symmetric, scale_dtype, helpers):
    layout = layout_of(3, symmetric, 32, scale_dtype, shape=(8, 100))
    grouped = grouping.group(helpers.tricky_weights(8, 100), 32)
    params, loaded = helpers.assert_store_load_round_trip(layout, grouped)
    assert (loaded.zero is None) == symmetric
    if not symmetric:
        assert torch.equal(loaded.zero, params.zero)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_round_to_nearest_is_bit_exact_with_the_native_fast_path(
    library, torch_quantize, bits, symmetric, scale_dtype, helpers
):
    for seed, (shape, group_size) in enumerate([((16, 256), 64), ((9, 200), 32), ((7, 577), None)]):
        layout = layout_of(bits, symmetric, group_size, scale_dtype, shape)
        weight = helpers.tricky_weights(*shape, seed)
        helpers.assert_same_bits(layout.quantize(weight), torch_quantize(layout, weight))


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_zero_scale_becomes_one_and_a_constant_group_is_exact(torch_quantize, symmetric):
    """Groups of zeros, of one repeated value, and of values whose scale underflows in float16."""
    weight = torch.zeros(3, 64)
    weight[1] = -0.37
    weight[2] = torch.linspace(-1e-9, 1e-9, 64)
    layout = layout_of(4, symmetric, 32, torch.float16, shape=(3, 64))
    stored = torch_quantize(layout, weight)
    assert torch.equal(stored["weight_scale"][0], torch.ones(2, dtype=torch.float16))
    assert torch.equal(stored["weight_scale"][2], torch.ones(2, dtype=torch.float16))
    assert torch.equal(layout.dequantize(stored)[0], weight[0])
    if not symmetric:  # scale 1, zero point -min: the constant group decodes to itself
        assert torch.equal(stored["weight_scale"][1], torch.ones(2, dtype=torch.float16))
        assert torch.equal(stored["weight_zero"][1], torch.full((2,), 0.37, dtype=torch.float16))
        assert torch.equal(layout.dequantize(stored)[1], weight[1].half().float())


def test_grid_with_low_gives_constant_groups_the_zero_point_minus_min():
    layout = layout_of(4, False, 32, torch.float16, shape=(2, 64))
    low = torch.tensor([[-0.5, 0.25], [1.0, -2.0]])
    params = layout.codec_object.grid(layout, torch.tensor([[0.0, 0.1], [0.1, 1e-12]]), torch.full((2, 2), 3.0), low)
    assert params.scale.tolist() == [[1.0, torch.tensor(0.1).half().item()], [torch.tensor(0.1).half().item(), 1.0]]
    assert params.zero.tolist() == [[0.5, 3.0], [3.0, 2.0]]


def test_symmetric_codes_round_before_the_integer_zero_point():
    """`round(w / s) + 2**(b-1)`: adding the zero point first would round `1.5 - 2**-23` up to 2."""
    layout = layout_of(8, True, None, shape=(1, 2))
    value = torch.tensor([[1.5 - 2**-23]])
    codes = layout.encode(value, torch.ones(1, 1), None)
    assert codes.item() == 128 + 1
