"""Bit packing and grouping, the pieces every packed codec shares."""

import pytest
import torch

from quantlab.formats import grouping, packing


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("length", [8, 37, 64, 129])
def test_pack_unpack_round_trip_is_bit_exact(bits, length):
    codes = torch.randint(0, 2**bits, (3, 5, length), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = packing.pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 5, packing.packed_size(length, bits))
    assert torch.equal(packing.unpack(packed, bits, length), codes)


@pytest.mark.parametrize("bits", range(2, 9))
def test_packed_size_is_bits_per_code(bits):
    assert packing.packed_size(256, bits) * 8 == 256 * bits


def test_pack_layout_is_little_endian_first_code_lowest():
    codes = torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    assert packing.pack(codes, 4).tolist() == [[0x21, 0x03, 0x00, 0x00]]
    assert packing.pack(codes, 2).tolist() == [[0b111001, 0]]


def test_pack_rejects_widths_outside_1_to_8():
    with pytest.raises(ValueError, match="between 1 and 8"):
        packing.pack(torch.zeros(1, 8, dtype=torch.uint8), 9)


def test_grouping_pads_with_last_value_and_ungroups():
    weight = torch.arange(10.0).reshape(2, 5)
    grouped = grouping.group(weight, 4)
    assert grouped.shape == (2, 2, 4)
    assert grouped[0, 1].tolist() == [4.0, 4.0, 4.0, 4.0]
    assert torch.equal(grouping.ungroup(grouped, 5), weight)
