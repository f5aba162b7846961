"""The AWQ checkpoint format of AutoAWQ and GPTQModel (`quant_method` "awq", `version` "gemm"), as quantlab reads it.

A quantized Linear layer `X` of 4 bits in groups of `group_size` input features stores:
- `X.qweight` int32 `[in, out / 8]`: the unsigned codes packed along the output dimension, eight to a
  word in AWQ's interleaved order: nibble `i` of word `c` (bits `4 i` to `4 i + 3`) holds the code of
  output feature `8 c + ORDER[i]`, `ORDER = (0, 2, 4, 6, 1, 3, 5, 7)`.
- `X.qzeros` int32 `[groups, out / 8]`: the whole zero points (0 to 15), packed the same way.
- `X.scales` `[groups, out]` float16.
A weight decodes as `(q - zero) * scale`, which is quantlab's asymmetric `custom_bits` grid with whole
zero points. The other packings (`gemv`, `gemv_fast`, `exllama`, `ipex`) rearrange the codes for one
kernel and are refused, as is `zero_point: false`.
"""

from dataclasses import dataclass
from typing import Any

import torch

from quantlab.formats.codec import IntegerGrid
from quantlab.interop.compressed_tensors import Scheme
from quantlab.interop.errors import ForeignCheckpointError

QUANT_METHOD = "awq"
BITS = 4
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output feature (within a word's eight) held by each nibble
QWEIGHT, QZEROS, SCALES = "qweight", "qzeros", "scales"
LAYER_TENSORS = (QWEIGHT, QZEROS, SCALES)


class AWQFormatError(ForeignCheckpointError):
    """An AWQ checkpoint quantlab cannot read exactly; the message says why."""


@dataclass(frozen=True)
class AWQConfig:
    """What an AWQ `quantization_config` says about every layer."""

    group_size: int | None

    @classmethod
    def read(cls, config: dict[str, Any]) -> "AWQConfig":
        bits = config.get("bits", config.get("w_bit", BITS))
        if bits != BITS:
            raise AWQFormatError(f"{bits}-bit AWQ codes: quantlab reads AWQ's 4-bit GEMM packing only")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise AWQFormatError(
                f"AWQ version {version!r} packs codes for one kernel; quantlab reads 'gemm' (re-save the model with "
                f"version='gemm')"
            )
        if not config.get("zero_point", True):
            raise AWQFormatError("AWQ zero_point=false: quantlab reads AWQ checkpoints with zero points only")
        group_size = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise AWQFormatError(f"AWQ group_size={group_size!r} is not a positive number or -1 (per channel)")
        return cls(None if group_size == -1 else group_size)

    @property
    def scheme(self) -> Scheme:
        return Scheme(BITS, self.group_size, symmetric=False)


def unpack_columns(words: torch.Tensor) -> torch.Tensor:
    """int32 words `[rows, n]` in AWQ's order → uint8 codes `[rows, 8 n]` in feature order."""
    shifts = torch.arange(8, dtype=torch.int64) * BITS
    nibbles = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF  # [rows, n, nibble]
    codes = torch.empty_like(nibbles)
    codes[..., list(ORDER)] = nibbles
    return codes.reshape(words.shape[0], -1).to(torch.uint8)


def read_layer(tensors: dict[str, torch.Tensor], config: AWQConfig, where: str) -> IntegerGrid:
    """A layer's AWQ tensors → its integer grid (codes and zero points unsigned, scales as stored)."""
    missing = [name for name in LAYER_TENSORS if name not in tensors]
    if missing:
        raise AWQFormatError(f"{where}: {', '.join(missing)} missing from the checkpoint")
    qweight, qzeros, scales = tensors[QWEIGHT], tensors[QZEROS], tensors[SCALES]
    cols, packed = qweight.shape
    groups, out = scales.shape
    if packed * 8 != out:
        raise AWQFormatError(f"{where}: qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} disagree")
    group = config.group_size or cols
    if cols % group or cols // group != groups:
        raise AWQFormatError(f"{where}: {cols} input features in groups of {group} are not the {groups} scale rows")
    if tuple(qzeros.shape) != (groups, packed):
        raise AWQFormatError(f"{where}: qzeros {tuple(qzeros.shape)} do not pack {groups} x {out} zero points")
    codes = unpack_columns(qweight).t().contiguous()
    zero = unpack_columns(qzeros).t().contiguous()
    return IntegerGrid(BITS, config.group_size, codes, scales.t().contiguous(), zero)
