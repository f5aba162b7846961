"""Presets: configs whose every stored matrix a GGUF block type holds exactly; options on top, refusals."""

import pytest

import quantlab
from quantlab.errors import ConfigError
from quantlab.presets import PRESETS, get_preset, preset_config, preset_names


def test_the_presets_are_the_gguf_grids():
    assert preset_names() == ["gguf-iq4_nl", "gguf-q4_0", "gguf-q8_0"]
    config = preset_config("gguf-q4_0")
    assert isinstance(config, quantlab.CustomBitsConfig)
    assert (config.bits, config.group_size, config.symmetric, config.scale_dtype) == (4, 32, True, "float16")
    assert (config.embedding_bits, config.embedding_group_size) == (8, 32)
    assert isinstance(preset_config("gguf-q8_0"), quantlab.Int8SymmetricConfig)
    assert isinstance(preset_config("gguf-iq4_nl"), quantlab.IQ4NLConfig)
    assert quantlab.preset_config is preset_config


def test_given_options_override_the_presets_own():
    config = preset_config("gguf-q4_0", group_size=64, solver="gptq", awq=True)
    assert (config.group_size, config.solver, config.awq, config.bits) == (64, "gptq", True, 4)
    assert preset_config("gguf-q8_0", group_size=None).group_size is None
    assert preset_config("gguf-iq4_nl", method="iq4_nl").method == "iq4_nl"


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("gguf-q4_0", {"symmetric": False}, r"exact GGUF Q4_0, which affine-asym 4-bit codes .* drop symmetric=False"),
        ("gguf-q4_0", {"bits": 8}, r"affine-sym 8-bit codes with torch.float16 scales are not; drop bits=8"),
        ("gguf-q4_0", {"scale_dtype": "float32"}, r"torch.float32 scales are not; drop scale_dtype='float32'"),
        ("gguf-q8_0", {"scale_dtype": "bfloat16"}, r"exact GGUF Q8_0, .* drop scale_dtype='bfloat16'"),
        ("gguf-iq4_nl", {"embedding_bits": None}, r"a float embedding table .* drop embedding_bits=None"),
        ("gguf-q4_0", {"target_bits": 4.5}, r"mixed precision .* drop target_bits=4.5"),
        (
            "gguf-q4_0",
            {"layer_options": {"model.layers.0.mlp.down_proj": {"symmetric": False}}},
            r"scales in model.layers.0.mlp.down_proj are not",
        ),
    ],
)
def test_options_the_gguf_type_cannot_hold_are_refused(name, options, message):
    with pytest.raises(ConfigError, match=message):
        preset_config(name, **options)


def test_another_method_or_an_unknown_preset_is_refused():
    with pytest.raises(ConfigError, match="quantizes with method 'iq4_nl', not 'nf4'; drop the method"):
        preset_config("gguf-iq4_nl", method="nf4")
    with pytest.raises(ConfigError, match="unknown preset 'gguf-q5_k'; known presets: gguf-iq4_nl, gguf-q4_0, gguf"):
        get_preset("gguf-q5_k")


def test_every_preset_names_a_registered_method():
    for preset in PRESETS.values():
        assert quantlab.get_method(preset.method).name == preset.method
