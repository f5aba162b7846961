"""The codecs' integer-grid hooks and compressed-tensors' int32 packing, against compressed-tensors' own code."""

import pytest
import torch

from quantlab.formats.codec import NotAnIntegerGrid
from quantlab.formats.layout import StorageLayout
from quantlab.interop import compressed_tensors as ct

WEIGHT = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "layout",
    [
        StorageLayout.build("affine", 4, 32, 96, 48, symmetric=True, scale_dtype=torch.float16),
        StorageLayout.build("affine", 8, None, 96, 48, symmetric=True, scale_dtype=torch.bfloat16),
        StorageLayout("int8", 8, 32, 96, 48, scale_dtype=torch.float32),
    ],
    ids=["affine-int4-sym", "affine-int8-channel", "int8"],
)
def test_integer_grid_round_trips_and_decodes_like_the_layout(layout) -> None:
    stored = layout.quantize(WEIGHT)
    grid = layout.codec_object.integer_grid(layout, stored)
    assert grid.symmetric and grid.scale.dtype == layout.scale_dtype and grid.codes.shape == (48, 96)
    decoded = (grid.codes.float() - (1 << (grid.bits - 1))).reshape(48, -1, grid.group_size or 96)
    decoded = (decoded * grid.scale.float().unsqueeze(-1)).reshape(48, 96)
    assert torch.equal(decoded, layout.dequantize(stored))
    again = layout.codec_object.from_integer_grid(layout, grid)
    assert again.keys() == stored.keys() and all(torch.equal(again[k], stored[k]) for k in stored)


def test_whole_zero_points_map_and_fractional_ones_are_refused() -> None:
    layout = StorageLayout.build("affine", 4, 32, 96, 48, symmetric=False, scale_dtype=torch.float16)
    stored = layout.quantize(WEIGHT)
    with pytest.raises(NotAnIntegerGrid, match="zero points are fractions"):
        layout.codec_object.integer_grid(layout, stored)
    stored["weight_zero"] = stored["weight_zero"].round().clamp(0, 15)
    grid = layout.codec_object.integer_grid(layout, stored)
    assert torch.equal(grid.zero.to(torch.float16), stored["weight_zero"])
    stored["weight_zero"][0, 0] = 16
    with pytest.raises(NotAnIntegerGrid, match="from 0 to 15"):
        layout.codec_object.integer_grid(layout, stored)


def test_nf4_and_padded_groups_are_no_integer_grid() -> None:
    nf4 = StorageLayout("nf4", 4, 32, 96, 48)
    with pytest.raises(NotAnIntegerGrid, match="NF4"):
        nf4.codec_object.integer_grid(nf4, nf4.quantize(WEIGHT))
    padded = StorageLayout.build("affine", 4, 64, 96, 48, symmetric=True)
    with pytest.raises(NotAnIntegerGrid, match="do not split into groups of 64"):
        padded.codec_object.integer_grid(padded, padded.quantize(WEIGHT))


@pytest.mark.parametrize("bits", ct.BITS)
@pytest.mark.parametrize("columns", [64, 72])
def test_int32_packing_is_compressed_tensors(bits, columns) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    codes = torch.randint(0, 1 << bits, (6, columns), generator=torch.Generator().manual_seed(bits))
    signed = (codes - (1 << (bits - 1))).to(torch.int8)
    packed = ct.pack_int32(codes.to(torch.uint8), bits)
    assert torch.equal(packed, helpers.pack_to_int32(signed, bits))
    assert torch.equal(ct.unpack_int32(packed, bits, columns), codes.to(torch.uint8))
    along_rows = helpers.pack_to_int32(signed.t().contiguous(), bits, packed_dim=0)
    assert torch.equal(ct.pack_int32(codes.to(torch.uint8), bits).t(), along_rows)
