"""A codec's own options live in its `options_type`: a codec defined here, with an option no built-in
codec has, builds layouts, quantizes, compares, hashes and round-trips through `layout_text` with
nothing edited outside this file.

The toy format: symmetric integer codes per group around a constant `shift` every weight of the layer
decodes shifted by, `w ≈ (q - 2**(b-1)) * scale + shift`. The shift is the layout's option, not a
stored tensor: two layouts differing only in it decode the same stored tensors differently.
"""

import dataclasses
import json

import pytest
import torch
from torch import nn

from quantlab.config import QuantlabConfig
from quantlab.formats import codec as codec_registry
from quantlab.formats import grouping, packing
from quantlab.formats.affine import AffineOptions
from quantlab.formats.codec import Codec, NoOptions, TensorSpec, register_codec
from quantlab.formats.layout import StorageLayout
from quantlab.formats.learned_table import LearnedTableOptions, start_table
from quantlab.formats.nf4 import NF4Options
from quantlab.kernels.experts import layout_text, parse_layout_text
from quantlab.kernels.reference import dequantize_matmul
from quantlab.nn import QuantizedLinear

BITS = 4
SHIFT = 0.5


@dataclasses.dataclass(frozen=True)
class ShiftOptions:
    shift: float = 0.0


class ShiftCodec(Codec):
    """Codes packed `bits` to the byte and a scale per group; the layer's `shift` is the layout's."""

    name = "toy_shift"
    options_type = ShiftOptions

    def tensors(self, layout: StorageLayout) -> dict[str, TensorSpec]:
        out, groups = layout.out_features, layout.groups
        return {
            "weight": TensorSpec((out, groups, packing.packed_size(layout.group_length, layout.bits)), torch.uint8),
            "weight_scale": TensorSpec((out, groups), layout.scale_dtype),
        }

    def quantize(self, layout: StorageLayout, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        grouped = grouping.group(weight.float() - layout.options.shift, layout.group_size)
        middle = 1 << (layout.bits - 1)
        scale = (grouped.abs().amax(dim=-1) / (middle - 1)).clamp(min=1e-8).to(layout.scale_dtype)
        codes = torch.round(grouped / scale.float().unsqueeze(-1)) + middle
        codes = codes.clamp(0, layout.max_code).to(torch.uint8)
        return {"weight": packing.pack(codes, layout.bits), "weight_scale": scale}

    def dequantize(
        self, layout: StorageLayout, stored: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        codes = packing.unpack(stored["weight"], layout.bits, layout.group_length).float()
        values = (codes - (1 << (layout.bits - 1))) * stored["weight_scale"].float().unsqueeze(-1)
        return (grouping.ungroup(values, layout.in_features) + layout.options.shift).to(dtype)


@dataclasses.dataclass(repr=False)
class ShiftConfig(QuantlabConfig):
    """The toy codec at 4 bits in groups of 32 (test only)."""

    method = "toy_shift"
    shift: float = 0.0


class ShiftLinear(QuantizedLinear):
    config_class = ShiftConfig

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: ShiftConfig) -> StorageLayout:
        return StorageLayout.build(ShiftCodec.name, BITS, 32, in_features, out_features, shift=config.shift)


@pytest.fixture(autouse=True)
def toy():
    """The toy codec registered for each test, and the registry as it was afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec_registry, "_CODECS", dict(codec_registry._CODECS))
        register_codec(ShiftCodec())
        yield
    assert ShiftCodec.name not in codec_registry.codec_names()


def shifted_weight(rows: int = 8, columns: int = 96) -> torch.Tensor:
    noise = torch.randn(rows, columns, generator=torch.Generator().manual_seed(0))
    return SHIFT + 0.02 * noise


def test_a_layout_carries_the_codecs_own_option():
    layout = StorageLayout.build("toy_shift", BITS, 32, 96, 8, shift=SHIFT)
    assert layout.options == ShiftOptions(shift=SHIFT)
    assert layout.options.shift == SHIFT
    assert StorageLayout("toy_shift", BITS, 32, 96, 8).options == ShiftOptions(shift=0.0)
    assert StorageLayout("toy_shift", BITS, 32, 96, 8, options=ShiftOptions(SHIFT)) == layout
    assert layout.tensors == {
        "weight": TensorSpec((8, 3, 16), torch.uint8),
        "weight_scale": TensorSpec((8, 3), torch.float32),
    }


def test_quantize_and_dequantize_honour_the_option():
    weight = shifted_weight()
    shifted = StorageLayout.build("toy_shift", BITS, 32, 96, 8, shift=SHIFT)
    plain = StorageLayout.build("toy_shift", BITS, 32, 96, 8, shift=0.0)
    stored = shifted.quantize(weight)
    scale = stored["weight_scale"].repeat_interleave(32, dim=1)
    error = (shifted.dequantize(stored) - weight).abs()
    assert bool((error <= scale / 2 + 1e-6).all())
    assert error.max() < 0.01  # steps of a 0.02-wide spread, not of the 0.5 offset
    # the stored tensors do not hold the shift: the layout does
    assert torch.allclose(shifted.dequantize(stored) - plain.dequantize(stored), torch.full_like(weight, SHIFT))
    # without the shift the codes spend their range on the offset: steps about ten times coarser
    plain_error = (plain.dequantize(plain.quantize(weight)) - weight).abs().max()
    assert plain_error > 4 * error.max()


def test_equality_and_hash_tell_option_values_apart():
    half = StorageLayout.build("toy_shift", BITS, 32, 96, 8, shift=0.5)
    assert half == StorageLayout.build("toy_shift", BITS, 32, 96, 8, shift=0.5)
    assert hash(half) == hash(StorageLayout.build("toy_shift", BITS, 32, 96, 8, shift=0.5))
    quarter = StorageLayout.build("toy_shift", BITS, 32, 96, 8, shift=0.25)
    assert half != quarter
    assert len({half, quarter, StorageLayout.build("toy_shift", BITS, 32, 96, 8, shift=0.5)}) == 2
    assert "ShiftOptions(shift=0.5)" in repr(half)
    assert dataclasses.replace(half, options=ShiftOptions(0.25)) == quarter


@pytest.mark.parametrize(
    "layout",
    [
        StorageLayout.build("affine", 4, 32, 96, 8, symmetric=False, scale_dtype=torch.float16),
        StorageLayout.build("nf4", 4, 64, 128, 8, double_quant=True),
        StorageLayout.build("lut", 3, 32, 96, 8, scale_dtype=torch.bfloat16, table=start_table(3)),
        StorageLayout("int8", 8, None, 96, 8),
    ],
    ids=["affine-asym", "nf4-dq", "lut-table", "int8"],
)
def test_layout_text_round_trips_built_in_options(layout):
    again = parse_layout_text(layout_text(layout))
    assert again == layout and type(again.options) is type(layout.options)


def test_layout_text_round_trips_the_toy_option():
    layout = StorageLayout.build("toy_shift", BITS, None, 96, 8, scale_dtype=torch.float16, shift=0.375)
    text = layout_text(layout)
    assert json.loads(text)["options"] == {"shift": 0.375}
    again = parse_layout_text(text)
    assert again == layout and again.options == ShiftOptions(0.375) and again.scale_dtype == torch.float16


def test_unknown_option_names_are_refused_naming_the_codecs_options():
    with pytest.raises(ValueError, match=r"^the toy_shift codec has no option offset \(its options: shift\)$"):
        StorageLayout.build("toy_shift", BITS, 32, 96, 8, offset=1.0)
    with pytest.raises(ValueError, match=r"^the int8 codec has no option symmetric \(its options: none\)$"):
        StorageLayout.build("int8", 8, None, 96, 8, symmetric=True)
    with pytest.raises(ValueError, match=r"the nf4 codec has no option symmetric, table \(its options: double_quant\)"):
        StorageLayout.build("nf4", 4, 64, 96, 8, table=None, symmetric=True)


def test_options_of_another_codec_are_refused():
    with pytest.raises(ValueError, match="the toy_shift codec takes ShiftOptions, got AffineOptions"):
        StorageLayout("toy_shift", BITS, 32, 96, 8, options=AffineOptions())
    with pytest.raises(ValueError, match="the affine codec takes AffineOptions, got NF4Options"):
        StorageLayout("affine", 4, 32, 96, 8, options=NF4Options(double_quant=True))
    with pytest.raises(ValueError, match="the iq4_nl codec takes NoOptions, got LearnedTableOptions"):
        StorageLayout("iq4_nl", 4, 32, 96, 8, scale_dtype=torch.float16, options=LearnedTableOptions())
    assert StorageLayout("int8", 8, None, 96, 8).options == NoOptions()


def test_a_quantized_layer_of_the_toy_layout_runs_on_the_reference_kernel():
    torch.manual_seed(0)
    linear = nn.Linear(96, 8)
    with torch.no_grad():
        linear.weight.copy_(shifted_weight())
    layer = ShiftLinear.from_linear(linear, ShiftConfig(shift=SHIFT))
    assert layer.layout.options == ShiftOptions(SHIFT)
    weight = layer.dequantize_weight()
    assert (weight - linear.weight).abs().max() < 0.01
    x = torch.randn(5, 96)
    with torch.no_grad():
        out = layer(x)
        assert torch.equal(out, dequantize_matmul(layer, x))
        torch.testing.assert_close(out, x @ weight.T + linear.bias, rtol=0, atol=1e-5)
        torch.testing.assert_close(out, linear(x), rtol=0, atol=0.05)
