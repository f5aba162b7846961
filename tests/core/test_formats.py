"""Bit-exact properties of the pure storage formats."""

import pytest
import torch

from quantlab.formats import affine, grouping, nf4, packing
from quantlab.formats.layout import StorageLayout, parse_descriptor


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


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [False, True])
def test_affine_error_is_at_most_half_a_step(bits, symmetric):
    torch.manual_seed(bits)
    weight = torch.randn(16, 200)
    quantized = affine.quantize(weight, bits, 64, symmetric)
    restored = affine.dequantize(quantized.codes, quantized.scale, quantized.zero, bits, 200)
    step = grouping.ungroup(quantized.scale.unsqueeze(-1).expand(-1, -1, 64), 200)
    # Symmetric grids clamp nothing (absmax maps to the top code); the bound is half a step.
    assert ((restored - weight).abs() <= step / 2 + 1e-6).all()
    assert int(quantized.codes.max()) < 2**bits


def test_affine_zero_group_is_exact():
    quantized = affine.quantize(torch.zeros(2, 64), 4, 32, False)
    assert torch.equal(affine.dequantize(quantized.codes, quantized.scale, quantized.zero, 4, 64), torch.zeros(2, 64))


def test_nf4_codes_equal_bitsandbytes():
    functional = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    weight = torch.randn(96, 256) * 0.02
    packed, _ = functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    flat = packed.reshape(-1)
    theirs = torch.stack([flat >> 4, flat & 15], dim=-1).reshape(96, 256)
    ours = nf4.quantize(weight, blocksize=64, double_quant=True).codes.reshape(96, 256)
    assert torch.equal(ours, theirs)


def test_nf4_double_quant_absmax_is_close_to_float():
    torch.manual_seed(0)
    weight = torch.randn(300, 512)
    plain = nf4.quantize(weight, 64, double_quant=False)
    double = nf4.quantize(weight, 64, double_quant=True)
    restored = nf4.dequantize_absmax(double.absmax_codes, double.absmax_scale, double.absmax_offset, 256)
    assert torch.equal(double.codes, plain.codes)
    assert ((restored - plain.absmax).abs() / plain.absmax).max() < 0.02


def test_dynamic_map_matches_bitsandbytes():
    functional = pytest.importorskip("bitsandbytes.functional")
    assert torch.allclose(torch.tensor(nf4.dynamic_map()), functional.create_dynamic_map(signed=True))


DESCRIBED_LAYOUTS = [
    (StorageLayout("affine", 4, 64, 576, 192), ("affine", 4, 576, 64, 0, 8.0)),
    (StorageLayout("affine", 3, 32, 100, 8, symmetric=False), ("affine", 3, 100, 32, 0, 0.0)),
    (StorageLayout("int8", 8, None, 576, 192), ("int8", 8, 576, 576, 0, 0.0)),
    (StorageLayout("nf4", 4, 64, 576, 192, double_quant=True), ("nf4", 4, 576, 64, nf4.ABSMAX_BLOCKSIZE, 0.0)),
    (StorageLayout("nf4", 4, 64, 576, 192), ("nf4", 4, 576, 64, 0, 0.0)),
]


@pytest.mark.parametrize(("layout", "fields"), DESCRIBED_LAYOUTS, ids=lambda value: getattr(value, "descriptor", ""))
def test_a_layout_descriptor_reads_back_as_its_decoding_integers(layout, fields):
    assert tuple(parse_descriptor(layout.descriptor)) == fields


MALFORMED = ["", "fp4 bits=4 in_features=8 group_size=8", "affine bits=4 in_features=8", "affine bits=x", "int8 x=3"]


@pytest.mark.parametrize("text", MALFORMED)
def test_a_malformed_descriptor_is_refused(text):
    with pytest.raises(ValueError, match="not a layout descriptor"):
        parse_descriptor(text)
