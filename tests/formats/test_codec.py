"""The codec registry, and what every layout says about itself: descriptor, native argument order."""

import pytest
import torch

from quantlab.formats import nf4
from quantlab.formats.codec import Codec, codec_names, get_codec, native_codecs
from quantlab.formats.layout import StorageLayout, parse_descriptor


def test_the_registry_holds_the_built_in_codecs_with_their_native_kinds():
    assert {"affine", "int8", "nf4"} <= set(codec_names())
    assert {name: kind for name, kind in native_codecs().items() if name in ("affine", "int8", "nf4")} == {
        "affine": 0,
        "int8": 1,
        "nf4": 2,
    }
    assert all(isinstance(get_codec(name), Codec) for name in codec_names())


def test_an_unknown_codec_names_the_known_ones():
    with pytest.raises(ValueError, match=r"codec 'fp4' is not one of \(.*'affine'.*'int8'.*'nf4'"):
        get_codec("fp4")
    with pytest.raises(ValueError, match="'fp4' is not one of"):
        StorageLayout("fp4", 4, 64, 64, 64)


def test_a_codec_refuses_a_width_it_does_not_store():
    with pytest.raises(ValueError, match="int8 codec stores 8-bit codes"):
        StorageLayout("int8", 4, None, 64, 8)
    with pytest.raises(ValueError, match="nf4 codec stores 4-bit codes"):
        StorageLayout("nf4", 3, 64, 64, 8)


DESCRIBED_LAYOUTS = [
    (StorageLayout("affine", 4, 64, 576, 192), ("affine", 4, 576, 64, 0, 8.0)),
    (StorageLayout.build("affine", 3, 32, 100, 8, symmetric=False), ("affine", 3, 100, 32, 0, 0.0)),
    (StorageLayout("int8", 8, None, 576, 192), ("int8", 8, 576, 576, 0, 0.0)),
    (StorageLayout.build("nf4", 4, 64, 576, 192, double_quant=True), ("nf4", 4, 576, 64, nf4.ABSMAX_BLOCKSIZE, 0.0)),
    (StorageLayout("nf4", 4, 64, 576, 192), ("nf4", 4, 576, 64, 0, 0.0)),
]


@pytest.mark.parametrize(("layout", "fields"), DESCRIBED_LAYOUTS, ids=lambda value: getattr(value, "descriptor", ""))
def test_a_layout_descriptor_reads_back_as_its_decoding_integers(layout, fields):
    assert tuple(parse_descriptor(layout.descriptor)) == fields
    assert parse_descriptor(layout.descriptor).codec_object is layout.codec_object


MALFORMED = ["", "fp4 bits=4 in_features=8 group_size=8", "affine bits=4 in_features=8", "affine bits=x", "int8 x=3"]


@pytest.mark.parametrize("text", MALFORMED)
def test_a_malformed_descriptor_is_refused(text):
    with pytest.raises(ValueError, match="not a layout descriptor"):
        parse_descriptor(text)


ARGUMENT_ORDER = [
    (StorageLayout("affine", 4, 64, 128, 8), ("weight_scale",)),
    (StorageLayout.build("affine", 4, 64, 128, 8, symmetric=False), ("weight_scale", "weight_zero")),
    (StorageLayout("int8", 8, None, 128, 8), ("weight_scale",)),
    (StorageLayout("nf4", 4, 64, 128, 8), ("weight_absmax",)),
    (
        StorageLayout.build("nf4", 4, 64, 128, 8, double_quant=True),
        (None, None, "weight_absmax_codes", "weight_absmax_scale", "weight_absmax_offset"),
    ),
]


@pytest.mark.parametrize(("layout", "names"), ARGUMENT_ORDER, ids=lambda value: getattr(value, "descriptor", ""))
def test_native_arguments_follow_the_operators_order(layout, names):
    """scale, zero, absmax_codes, absmax_scale, absmax_offset; every name is a stored tensor."""
    assert layout.native_arguments == names
    assert {name for name in names if name} | {"weight"} == set(layout.tensors)


def test_describe_gives_an_exporter_the_grid_in_plain_numbers():
    layout = StorageLayout.build("affine", 3, 32, 64, 8, symmetric=False, scale_dtype=torch.float16)
    facts = layout.codec_object.describe(layout)
    assert facts == {
        "codec": "affine",
        "bits": 3,
        "group_length": 32,
        "zero_point": "stored",
        "scale_dtype": "float16",
        "levels": None,
        "signed_grids": False,
    }
    layout = StorageLayout("nf4", 4, 64, 64, 8)
    facts = layout.codec_object.describe(layout)
    assert facts["levels"] == list(torch.tensor(nf4.NF4_LEVELS).tolist())
    assert facts["zero_point"] == "constant" and facts["constant_zero"] == 0.0


@pytest.mark.parametrize(
    ("layout", "label"),
    [
        (StorageLayout("int8", 8, None, 64, 8), "int8"),
        (StorageLayout("affine", 4, 32, 64, 8), "affine-sym"),
        (StorageLayout.build("affine", 4, 32, 64, 8, symmetric=False), "affine-asym"),
        (StorageLayout("nf4", 4, 32, 64, 8), "nf4"),
    ],
)
def test_each_codec_names_itself_for_inspect(layout, label):
    assert layout.codec_object.label(layout) == label


ROUND_TRIP_LAYOUTS = [
    StorageLayout("affine", 2, 32, 64, 8),
    StorageLayout("affine", 3, 32, 64, 8),
    StorageLayout.build("affine", 4, 32, 64, 8, symmetric=False),
    StorageLayout("int8", 8, None, 64, 8),
    StorageLayout("nf4", 4, 32, 64, 8),
    StorageLayout("iq4_nl", 4, 32, 64, 8, scale_dtype=torch.float16),
    StorageLayout("lut", 3, 32, 64, 8, scale_dtype=torch.float16),
]


@pytest.mark.parametrize("layout", ROUND_TRIP_LAYOUTS, ids=lambda layout: layout.descriptor)
def test_round_trip_is_decode_of_encode_and_the_codes_levels_bit_for_bit(layout):
    """What a fake quantizer computes at each step (`round_trip`) is the codec's own encode and decode."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 64, generator=generator)
    layout = layout.prepare(weight)
    grouped = weight.view(8, 64 // layout.group_length, layout.group_length)
    params = layout.fit(grouped)
    scale = params.scale.unsqueeze(-1)
    zero = None if params.zero is None else params.zero.unsqueeze(-1)
    # Beyond the grid's ends (clipped), and exactly half-way between integer codes (ties).
    values = torch.cat([grouped * 3, grouped, (torch.round(grouped / scale) + 0.5) * scale], dim=0)
    scale, zero = scale.repeat(3, 1, 1), None if zero is None else zero.repeat(3, 1, 1)
    codes = layout.encode(values, scale, zero)
    decoded, level = layout.round_trip(values, scale, zero)
    levels = layout.levels()
    assert torch.equal(decoded, layout.decode(codes, scale, zero))
    assert torch.equal(level, codes.float() if levels is None else levels.float()[codes.long()])
