"""Presets: named settings whose every stored matrix lands on a llama.cpp grid, so the GGUF export is exact.

A preset is a method and the options that make its codes those of one GGUF block type: float16
scales (rounded before the codes are chosen, as the codecs always do), groups that are whole
32-weight blocks, and the vocabulary table (tied head included) in int8 with one float16 scale per
32 weights, which is Q8_0. Any solver works on top (`solver="gptq"`, `awq=True`: AWQ's scales are
folded into the norms and projections before it, which GGUF stores as they are), and
`quantlab export gguf` then writes every matrix from quantlab's own codes (`exact=True` passes).

| preset | method | Linear layers | GGUF type |
| --- | --- | --- | --- |
| `gguf-q4_0` | custom_bits, 4-bit symmetric, group 32 | `(q - 8) * d` | Q4_0 |
| `gguf-q8_0` | int8, group 32 | `q * d` | Q8_0 |
| `gguf-iq4_nl` | iq4_nl, group 32 | `kvalues[q] * d` | IQ4_NL |

Options given beside a preset override its own (a group size of 64 is still exact: its scale is
repeated in both blocks, at the same file size). Options the preset's GGUF type cannot hold (an
asymmetric grid, float32 scales, a float table, mixed precision) raise `ConfigError` naming them.
"""

import dataclasses
from typing import Any

import torch

from quantlab.config import QuantlabConfig
from quantlab.errors import ConfigError
from quantlab.formats.codec import GGUF_BLOCK
from quantlab.registry import get_method

_TABLE = {"embedding_bits": 8, "embedding_group_size": 32}


@dataclasses.dataclass(frozen=True)
class Preset:
    """A method and its options; `gguf_type` is the block type its Linear layers export as."""

    name: str
    method: str
    options: dict[str, Any]
    gguf_type: str
    description: str


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            "gguf-q4_0",
            "custom_bits",
            {"bits": 4, "group_size": 32, "symmetric": True, "scale_dtype": "float16", **_TABLE},
            "Q4_0",
            "4-bit symmetric integers in groups of 32, float16 scales: llama.cpp's Q4_0",
        ),
        Preset(
            "gguf-q8_0",
            "int8",
            {"group_size": 32, "scale_dtype": "float16", **_TABLE},
            "Q8_0",
            "int8 in groups of 32, float16 scales: llama.cpp's Q8_0",
        ),
        Preset(
            "gguf-iq4_nl",
            "iq4_nl",
            {"group_size": 32, **_TABLE},
            "IQ4_NL",
            "llama.cpp's non-uniform 4-bit table in groups of 32, float16 scales: IQ4_NL",
        ),
    )
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> Preset:
    """The preset called `name`; ConfigError naming the known ones otherwise."""
    preset = PRESETS.get(name)
    if preset is None:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    return preset


def preset_config(name: str, method: str | None = None, **options: Any) -> QuantlabConfig:
    """The config of preset `name` with `options` on top (given options win over the preset's).

    `method`, when given, must be the preset's own. ConfigError when the options make some stored
    matrix something the preset's GGUF type does not hold exactly.
    """
    preset = get_preset(name)
    if method is not None and method != preset.method:
        raise ConfigError(f"preset {name!r} quantizes with method {preset.method!r}, not {method!r}; drop the method")
    config = get_method(preset.method).config_class.from_options({**preset.options, **options})
    _check_exact(preset, config, options)
    return config


def _check_exact(preset: Preset, config: QuantlabConfig, options: dict[str, Any]) -> None:
    changed = ", ".join(f"{key}={value!r}" for key, value in options.items() if preset.options.get(key) != value)
    refuse = f"preset {preset.name!r} writes exact GGUF {preset.gguf_type}, which %s; drop {changed or 'the options'}"
    if config.target_bits is not None:
        raise ConfigError(refuse % "mixed precision (target_bits) would not keep")
    if config.embedding_bits is None:
        raise ConfigError(refuse % "a float embedding table (embedding_bits=None) would not be: it would be rounded")
    module_class = get_method(preset.method).module_class
    for layer in ("", *(config.layer_options or {})):
        layout = module_class.layout_for(GGUF_BLOCK * 8, GGUF_BLOCK, config.config_for(layer))
        kind = layout.codec_object.gguf_type(layout)
        if kind != preset.gguf_type or layout.scale_dtype != torch.float16:
            what = f"{layout.codec_object.label(layout)} {layout.bits}-bit codes with {layout.scale_dtype} scales"
            where = f" in {layer}" if layer else ""
            raise ConfigError(refuse % f"{what}{where} are not")
