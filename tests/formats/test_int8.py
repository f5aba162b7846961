"""The int8 codec: the 8-bit symmetric grid, its codes stored as signed bytes."""

import pytest
import torch

from quantlab.formats import grouping
from quantlab.formats.layout import StorageLayout


@pytest.mark.parametrize("group_size", [None, 64])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_codes_are_signed_bytes_q_and_round_trip(group_size, scale_dtype, helpers):
    layout = StorageLayout("int8", 8, group_size, 128, 8, scale_dtype=scale_dtype)
    weight = helpers.tricky_weights(8, 128)
    stored = layout.quantize(weight)
    helpers.assert_matches_specs(layout, stored)
    scale = grouping.ungroup(stored["weight_scale"].float().unsqueeze(-1).expand(-1, -1, layout.group_length), 128)
    assert torch.equal(stored["weight"].reshape(8, -1).float() * scale, layout.dequantize(stored))
    assert int(stored["weight"].abs().max()) <= 127
    codes, params = layout.load(stored)
    assert torch.equal(layout.store(codes, params)["weight"], stored["weight"])


def test_round_to_nearest_is_bit_exact_with_the_native_fast_path(library, torch_quantize, helpers):
    for seed, group_size in enumerate([None, 64, 32]):
        layout = StorageLayout("int8", 8, group_size, 256, 16, scale_dtype=torch.float16)
        weight = helpers.tricky_weights(16, 256, seed)
        helpers.assert_same_bits(layout.quantize(weight), torch_quantize(layout, weight))


def test_a_group_of_zeros_gets_scale_one_and_decodes_to_zeros(torch_quantize):
    layout = StorageLayout("int8", 8, 32, 64, 2)
    stored = torch_quantize(layout, torch.zeros(2, 64))
    assert torch.equal(stored["weight_scale"], torch.ones(2, 2))
    assert torch.equal(layout.dequantize(stored), torch.zeros(2, 64))


def test_storing_leaves_the_callers_codes_alone():
    layout = StorageLayout("int8", 8, None, 8, 1)
    codes = torch.arange(120, 136, 2, dtype=torch.uint8).reshape(1, 1, 8)
    before = codes.clone()
    params = layout.grid(torch.ones(1, 1))
    assert layout.store(codes, params)["weight"].tolist() == [[[-8, -6, -4, -2, 0, 2, 4, 6]]]
    assert torch.equal(codes, before)
