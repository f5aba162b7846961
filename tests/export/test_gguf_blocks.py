"""GGUF blocks: the byte layouts against gguf-py's own decoder, and each codec's mapping of its codes to them."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from quantlab.export.gguf.blocks import BLOCK_BYTES, pack  # noqa: E402
from quantlab.formats import iq4_nl  # noqa: E402
from quantlab.formats.codec import GGUFBlocks, NotExactInGGUF  # noqa: E402
from quantlab.formats.layout import StorageLayout  # noqa: E402


def _random_blocks(kind: str, rows: int = 3, columns: int = 96, seed: int = 0) -> GGUFBlocks:
    generator = torch.Generator().manual_seed(seed)
    blocks = columns // 32
    scale = (torch.rand(rows, blocks, generator=generator) - 0.5).half()
    if kind == "Q8_0":
        codes = torch.randint(-128, 128, (rows, columns), generator=generator).to(torch.int8)
        return GGUFBlocks(kind, codes, scale)
    codes = torch.randint(0, 16, (rows, columns), generator=generator).to(torch.uint8)
    minimum = (torch.rand(rows, blocks, generator=generator) - 0.5).half() if kind == "Q4_1" else None
    return GGUFBlocks(kind, codes, scale, minimum)


def _expected(blocks: GGUFBlocks) -> np.ndarray:
    """The block formulas of ggml-common.h, in float32."""
    d = blocks.scale.float().repeat_interleave(32, dim=1)
    q = blocks.codes.float()
    if blocks.type == "Q4_0":
        return ((q - 8) * d).numpy()
    if blocks.type == "Q4_1":
        return (q * d + blocks.min.float().repeat_interleave(32, dim=1)).numpy()
    if blocks.type == "IQ4_NL":
        return (iq4_nl.levels()[blocks.codes.long()] * d).numpy()
    return (q * d).numpy()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "IQ4_NL"])
def test_packed_blocks_decode_bit_exactly_with_gguf(kind) -> None:
    blocks = _random_blocks(kind)
    data = pack(blocks)
    assert data.dtype == np.uint8 and data.shape == (3, 3 * BLOCK_BYTES[kind])
    decoded = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    np.testing.assert_array_equal(decoded, _expected(blocks))


def test_q4_0_nibble_order_is_low_then_high_half() -> None:
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).reshape(1, 32)
    data = pack(GGUFBlocks("Q4_0", codes, torch.ones(1, 1).half()))
    assert data[0, 2] == codes[0, 0] | (codes[0, 16] << 4)
    assert data[0, 17] == codes[0, 15] | (codes[0, 31] << 4)


def test_gguf_quantized_bytes_repack_identically() -> None:
    """Bytes gguf-py's quantizer writes, read as (codes, d) and packed again, are the same bytes."""
    values = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    blocks = data.reshape(4, 2, 34)
    scale = torch.from_numpy(blocks[..., :2].copy().view(np.float16)).reshape(4, 2)
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(4, 64)
    np.testing.assert_array_equal(pack(GGUFBlocks("Q8_0", codes, scale)), data)


# -- the codecs' mapping ------------------------------------------------------------------------------


def _weight(rows: int = 8, columns: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))


def _layout(codec: str, bits: int, group_size, columns: int = 128, **options) -> StorageLayout:
    return StorageLayout.build(codec, bits, group_size, columns, 8, **options)


def _decoded(blocks: GGUFBlocks) -> np.ndarray:
    return gguf.quants.dequantize(pack(blocks), gguf.GGMLQuantizationType[blocks.type])


@pytest.mark.parametrize(
    ("codec", "bits", "group_size", "kind"),
    [
        ("affine", 4, 32, "Q4_0"),
        ("affine", 4, 64, "Q4_0"),
        ("affine", 4, 128, "Q4_0"),
        ("affine", 4, None, "Q4_0"),
        ("affine", 3, 32, "Q4_0"),
        ("affine", 2, 64, "Q4_0"),
        ("affine", 8, 64, "Q8_0"),
        ("affine", 6, 32, "Q8_0"),
        ("int8", 8, 32, "Q8_0"),
        ("int8", 8, None, "Q8_0"),
    ],
)
def test_symmetric_codes_with_float16_scales_are_exact(codec, bits, group_size, kind) -> None:
    layout = _layout(codec, bits, group_size, scale_dtype=torch.float16)  # affine: symmetric by default
    stored = layout.quantize(_weight())
    assert layout.codec_object.gguf_type(layout) == kind
    blocks = layout.codec_object.gguf_blocks(layout, stored)
    assert blocks.type == kind
    np.testing.assert_array_equal(_decoded(blocks), layout.dequantize(stored).numpy())


@pytest.mark.parametrize("group_size", [32, 64, 256])
def test_iq4_nl_codes_and_scales_are_iq4_nl_blocks(group_size) -> None:
    layout = _layout("iq4_nl", 4, group_size, columns=256, scale_dtype=torch.float16)
    stored = layout.quantize(_weight(columns=256) * 0.02)
    blocks = layout.codec_object.gguf_blocks(layout, stored)
    assert blocks.type == layout.codec_object.gguf_type(layout) == "IQ4_NL"
    assert torch.equal(blocks.codes, layout.codes(stored["weight"]).reshape(8, 256))
    np.testing.assert_array_equal(_decoded(blocks), layout.dequantize(stored).numpy())


def test_iq4_nl_rows_that_do_not_fill_blocks_are_refused() -> None:
    layout = _layout("iq4_nl", 4, 32, columns=80, scale_dtype=torch.float16)
    with pytest.raises(NotExactInGGUF, match="multiples of 32"):
        layout.codec_object.gguf_blocks(layout, layout.quantize(_weight(columns=80)))


def test_float32_scales_that_float16_cannot_hold_are_refused() -> None:
    layout = _layout("int8", 8, 32, scale_dtype=torch.float32)
    with pytest.raises(NotExactInGGUF, match="not a float16 number"):
        layout.codec_object.gguf_blocks(layout, layout.quantize(_weight()))


def test_float32_scales_that_are_float16_numbers_are_exact() -> None:
    layout = _layout("affine", 4, 32, scale_dtype=torch.float32)
    stored = layout.quantize(_weight())
    stored["weight_scale"] = stored["weight_scale"].half().float()
    blocks = layout.codec_object.gguf_blocks(layout, stored)
    np.testing.assert_array_equal(_decoded(blocks), layout.dequantize(stored).numpy())


def test_rows_that_do_not_fill_blocks_are_refused() -> None:
    layout = _layout("affine", 4, None, columns=48, scale_dtype=torch.float16)
    with pytest.raises(NotExactInGGUF, match="multiples of 32"):
        layout.codec_object.gguf_blocks(layout, layout.quantize(_weight(columns=48)))


def test_asymmetric_4_bit_is_q4_1_when_float16_holds_the_minimum() -> None:
    layout = _layout("affine", 4, 32, symmetric=False, scale_dtype=torch.float16)
    stored = layout.quantize(_weight())
    # Scales of a few significant bits and whole zero points: -zero * scale is a float16 number.
    stored["weight_scale"] = torch.full_like(stored["weight_scale"], 0.125)
    stored["weight_zero"] = torch.randint(0, 16, stored["weight_zero"].shape).to(torch.float16)
    blocks = layout.codec_object.gguf_blocks(layout, stored)
    assert blocks.type == "Q4_1"
    np.testing.assert_array_equal(_decoded(blocks), layout.dequantize(stored).numpy())


def test_asymmetric_4_bit_with_fractional_zero_points_is_refused() -> None:
    layout = _layout("affine", 4, 32, symmetric=False, scale_dtype=torch.float16)
    with pytest.raises(NotExactInGGUF, match="minimum"):
        layout.codec_object.gguf_blocks(layout, layout.quantize(_weight()))


def test_wider_asymmetric_codes_and_nf4_have_no_gguf_type() -> None:
    wide = _layout("affine", 5, 32, symmetric=False, scale_dtype=torch.float16)
    nf4 = _layout("nf4", 4, 64)
    assert wide.codec_object.gguf_type(wide) is None and nf4.codec_object.gguf_type(nf4) is None
    with pytest.raises(NotExactInGGUF, match="Q4_1"):
        wide.codec_object.gguf_blocks(wide, wide.quantize(_weight()))
    with pytest.raises(NotExactInGGUF, match="NF4"):
        nf4.codec_object.gguf_blocks(nf4, nf4.quantize(_weight()))
