"""The compressed-tensors format (vLLM's and llm-compressor's checkpoints), as far as quantlab reads and writes it.

A quantized Linear layer `X` of an integer scheme stores, in "pack-quantized" format:
- `X.weight_packed` int32 `[out, ceil(in * bits / 32)]`: the codes of each row, `32 / bits` to a
  word, code `i` at bit `bits * (i % (32 / bits))` of word `i // (32 / bits)`. A code is the signed
  value `q` (`-2**(bits-1) .. 2**(bits-1) - 1`) plus `2**(bits-1)`: quantlab's unsigned code.
- `X.weight_scale` `[out, groups]` (`[out, 1]` per channel), in its own float dtype.
- `X.weight_zero_point` (asymmetric schemes only) int32 `[ceil(out * bits / 32), groups]`: the
  signed zero points packed like the codes, along the output dimension.
- `X.weight_shape` int64 `[2]`: `[out, in]`.
A weight decodes as `(q - zero_point) * scale`. "int-quantized" / "naive-quantized" store the
signed codes unpacked in an int8 `X.weight` and the zero points as int8 `[out, groups]`.

The config.json entry (`quantization_config`, `quant_method` "compressed-tensors") holds one
`config_groups` entry per scheme (`targets`: class names, exact module names or `re:` patterns),
the float modules in `ignore`, the `format` and `quantization_status` "compressed".
"""

import dataclasses
import re
from typing import Any

import torch

from quantlab.formats.codec import IntegerGrid
from quantlab.interop.errors import ForeignCheckpointError

QUANT_METHOD = "compressed-tensors"
PACKED_FORMAT = "pack-quantized"
PLAIN_FORMATS = ("int-quantized", "naive-quantized")
FORMATS = (PACKED_FORMAT, *PLAIN_FORMATS)
BITS = (4, 8)  # the integer widths vLLM's and transformers' compressed-tensors kernels read
STRATEGIES = ("group", "channel", "tensor")

PACKED, SCALE, ZERO, SHAPE, PLAIN = "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight"
ACTORDER_INDEX = "weight_g_idx"
LAYER_TENSORS = (PACKED, SCALE, ZERO, SHAPE, PLAIN, ACTORDER_INDEX)


class CompressedTensorsFormatError(ForeignCheckpointError):
    """A compressed-tensors checkpoint or scheme quantlab cannot read or write exactly; the message says why."""


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One integer weight scheme: `bits`, `group_size` (None: one group per output channel), zero points or not."""

    bits: int
    group_size: int | None
    symmetric: bool

    @property
    def strategy(self) -> str:
        return "channel" if self.group_size is None else "group"

    def label(self) -> str:
        grouping = "per channel" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.bits} {grouping} {'sym' if self.symmetric else 'asym'}"

    def weights_json(self) -> dict[str, Any]:
        """The scheme's `weights` entry, as compressed-tensors' `QuantizationArgs` serializes it."""
        weights: dict[str, Any] = {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": self.strategy,
            "dynamic": False,
            "observer": "minmax",
        }
        if not self.symmetric:
            weights["zp_dtype"] = "torch.int8"
        return weights


def scheme_of(weights: dict[str, Any], where: str) -> tuple[Scheme, str]:
    """A config group's `weights` entry → its `Scheme` and strategy; refuses what has no integer grid."""
    kind = str(weights.get("type", "int")).lower()
    bits = weights.get("num_bits")
    strategy = str(weights.get("strategy") or ("group" if weights.get("group_size") else "tensor")).lower()
    if kind != "int":
        raise CompressedTensorsFormatError(f"{where}: {kind} weights are not integer codes; quantlab reads int weights")
    if bits not in BITS:
        raise CompressedTensorsFormatError(
            f"{where}: {bits}-bit weights; quantlab reads {' and '.join(map(str, BITS))}"
        )
    if strategy not in STRATEGIES:
        raise CompressedTensorsFormatError(
            f"{where}: the {strategy!r} strategy has no quantlab layout; quantlab reads {', '.join(STRATEGIES)}"
        )
    if weights.get("dynamic") not in (False, None, "false"):
        raise CompressedTensorsFormatError(f"{where}: dynamic weight quantization stores no codes to read")
    group_size = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise CompressedTensorsFormatError(f"{where}: group strategy without a positive group_size ({group_size!r})")
    return Scheme(bits, group_size, bool(weights.get("symmetric", True))), strategy


# -- packing ---------------------------------------------------------------------------------------


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes `[rows, cols]` → int32 words `[rows, ceil(cols * bits / 32)]` (see the module docstring)."""
    per_word = 32 // bits
    rows, cols = codes.shape
    words = -(-cols // per_word)
    padded = torch.nn.functional.pad(codes.to(torch.int64), (0, words * per_word - cols))
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    unsigned = (padded.reshape(rows, words, per_word) << shifts).sum(dim=-1)
    return torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned).to(torch.int32)


def unpack_int32(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words `[rows, n]` → `cols` unsigned codes (uint8) per row."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    values = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(words.shape[0], -1)[:, :cols].to(torch.uint8)


# -- one layer's tensors ---------------------------------------------------------------------------


def layer_tensors(grid: IntegerGrid) -> dict[str, torch.Tensor]:
    """A layer's integer grid → its pack-quantized tensors (names without the layer prefix)."""
    out, cols = grid.codes.shape
    tensors = {
        PACKED: pack_int32(grid.codes, grid.bits),
        SCALE: grid.scale.contiguous(),
        SHAPE: torch.tensor([out, cols], dtype=torch.int64),
    }
    if grid.zero is not None:
        tensors[ZERO] = pack_int32(grid.zero.t(), grid.bits).t().contiguous()
    return tensors


def read_layer(tensors: dict[str, torch.Tensor], scheme: Scheme, strategy: str, where: str) -> IntegerGrid:
    """A layer's stored tensors (pack-quantized or unpacked int8) → its integer grid, checked against `scheme`."""
    offset = 1 << (scheme.bits - 1)
    if ACTORDER_INDEX in tensors:
        index = tensors[ACTORDER_INDEX]
        if not torch.equal(index.long(), torch.arange(index.numel()) // (scheme.group_size or index.numel())):
            raise CompressedTensorsFormatError(
                f"{where}: groups in activation order (weight_g_idx) are not contiguous, which quantlab's groups are"
            )
    if PACKED in tensors:
        if SHAPE not in tensors:
            raise CompressedTensorsFormatError(f"{where}: {PACKED} without {SHAPE}")
        out, cols = (int(v) for v in tensors[SHAPE].tolist())
        codes = unpack_int32(tensors[PACKED], scheme.bits, cols)
    elif PLAIN in tensors and not tensors[PLAIN].is_floating_point():
        codes = (tensors[PLAIN].to(torch.int16) + offset).to(torch.uint8)
        out, cols = codes.shape
    else:
        raise CompressedTensorsFormatError(f"{where}: neither {PACKED} nor an integer {PLAIN} is stored")
    if SCALE not in tensors:
        raise CompressedTensorsFormatError(f"{where}: {SCALE} is missing")
    group = scheme.group_size or cols
    if cols % group:
        raise CompressedTensorsFormatError(f"{where}: {cols} input features do not split into groups of {group}")
    scale = _per_group(tensors[SCALE], out, cols // group, strategy, f"{where}.{SCALE}")
    zero = None
    if not scheme.symmetric:
        if ZERO not in tensors:
            raise CompressedTensorsFormatError(f"{where}: an asymmetric scheme without {ZERO}")
        stored = tensors[ZERO]
        if stored.dtype == torch.int32 and PACKED in tensors:
            signed = unpack_int32(stored.t().contiguous(), scheme.bits, out).t().to(torch.int16) - offset
        else:
            signed = stored.to(torch.int16)
        signed = _per_group(signed, out, cols // group, strategy, f"{where}.{ZERO}")
        if signed.numel() and (int(signed.min()) < -offset or int(signed.max()) >= offset):
            raise CompressedTensorsFormatError(f"{where}: zero points outside the {scheme.bits}-bit range")
        zero = (signed + offset).to(torch.uint8)
    return IntegerGrid(scheme.bits, scheme.group_size, codes, scale, zero)


def _per_group(values: torch.Tensor, out: int, groups: int, strategy: str, where: str) -> torch.Tensor:
    """Scales or zero points as `[out, groups]`: one per tensor is repeated for every row."""
    if strategy == "tensor" and values.numel() == 1:
        return values.reshape(1, 1).expand(out, 1).contiguous()
    values = values.reshape(values.shape[0], -1) if values.dim() != 1 else values.reshape(-1, 1)
    if tuple(values.shape) != (out, groups):
        raise CompressedTensorsFormatError(
            f"{where} has shape {tuple(values.shape)}, the scheme needs {(out, groups)} ({out} rows, {groups} groups)"
        )
    return values


# -- config.json -----------------------------------------------------------------------------------


def quantization_config(
    schemes: dict[Scheme, list[str]], ignore: list[str], version: str, experts: list[list[str]] | None = None
) -> dict[str, Any]:
    """The `quantization_config` entry of a pack-quantized checkpoint: `schemes` maps each scheme to its
    layers (one scheme targets every Linear layer not in `ignore`; several target their layers by name).

    `experts` lists the per-expert Linear layers of mixtures of experts (all in one scheme), one list per
    layer and projection naming it for every expert: with several schemes, their group targets them by one
    `re:` pattern naming `experts`, by which transformers' loader finds the experts' scheme."""
    single = len(schemes) == 1
    families = experts or []
    groups = {
        f"group_{index}": {
            "targets": ["Linear"] if single else _targets(layers, families),
            "weights": scheme.weights_json(),
            "input_activations": None,
            "output_activations": None,
            "format": PACKED_FORMAT,
        }
        for index, (scheme, layers) in enumerate(schemes.items())
    }
    return {
        "quant_method": QUANT_METHOD,
        "format": PACKED_FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": version,
    }


def _targets(layers: list[str], experts: list[list[str]]) -> list[str]:
    """A group's targets by name: its layers, the experts' ones as one `re:` pattern."""
    mine = set(layers)
    families = [family for family in experts if mine.intersection(family)]
    expert_layers = {name for family in families for name in family}
    named = sorted(layer for layer in layers if layer not in expert_layers)
    return named + ([_experts_target(families)] if families else [])


def _experts_target(families: list[list[str]]) -> str:
    """One `re:` target matching the per-expert layers of `families` (each: one layer and projection, named for
    every expert, `...experts.0.gate_proj`, `...experts.1.gate_proj`, ...), any expert index in place of theirs."""
    templates = set()
    for family in families:
        split = [name.split(".") for name in family]
        varying = {i for i in range(len(split[0])) if len({parts[i] for parts in split}) > 1}
        templates.add(r"\.".join(r"\d+" if i in varying else re.escape(part) for i, part in enumerate(split[0])))
    return "re:^(?:" + "|".join(sorted(templates)) + ")$"


@dataclasses.dataclass(frozen=True)
class ConfigGroup:
    """One `config_groups` entry as read: its scheme, format and whom it targets."""

    name: str
    scheme: Scheme
    strategy: str
    format: str
    targets: tuple[str, ...]
    dynamic_activations: bool


def read_config(config: dict[str, Any]) -> tuple[list[ConfigGroup], list[str]]:
    """The config groups and the `ignore` list of a compressed-tensors `quantization_config`."""
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise CompressedTensorsFormatError(
            f"quantization_status is {status!r}: its weights are not stored as codes (only 'compressed' ones are)"
        )
    if config.get("transform_config"):
        raise CompressedTensorsFormatError("the checkpoint applies transforms (transform_config), which quantlab lacks")
    default_format = config.get("format") or PACKED_FORMAT
    groups = []
    for name, group in (config.get("config_groups") or {}).items():
        where = f"config group {name!r}"
        if group.get("weights") is None:
            raise CompressedTensorsFormatError(f"{where} quantizes no weights; quantlab reads weight quantization")
        scheme, strategy = scheme_of(group["weights"], where)
        fmt = group.get("format") or default_format
        if fmt not in FORMATS:
            raise CompressedTensorsFormatError(f"{where}: format {fmt!r}; quantlab reads {', '.join(FORMATS)}")
        activations = group.get("input_activations")
        if activations and not activations.get("dynamic"):
            raise CompressedTensorsFormatError(
                f"{where} quantizes activations with static scales; quantlab runs weight-only schemes"
            )
        if group.get("output_activations"):
            raise CompressedTensorsFormatError(
                f"{where} quantizes output activations; quantlab runs weight-only schemes"
            )
        groups.append(ConfigGroup(name, scheme, strategy, fmt, tuple(group.get("targets") or ()), bool(activations)))
    if not groups:
        raise CompressedTensorsFormatError("quantization_config has no config_groups")
    return groups, list(config.get("ignore") or [])


def group_of(layer: str, groups: list[ConfigGroup]) -> ConfigGroup:
    """The group a stored layer belongs to: one naming it (exactly or by `re:`) before one naming a class."""
    for group in groups:
        if any(_names(layer, target) for target in group.targets):
            return group
    by_class = [group for group in groups if any(not _is_name_target(t) for t in group.targets)]
    if len(by_class) == 1:
        return by_class[0]
    if not by_class:
        raise CompressedTensorsFormatError(f"{layer} stores codes but no config group targets it")
    return by_class[0]


def _names(layer: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), layer) is not None
    return target == layer


def _is_name_target(target: str) -> bool:
    return target.startswith("re:") or "." in target
