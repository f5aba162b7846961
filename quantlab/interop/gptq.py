"""The GPTQ checkpoint format of AutoGPTQ and GPTQModel (`quant_method` "gptq"), as quantlab reads it.

A quantized Linear layer `X` of `bits` bits (2, 4 or 8) in groups of `group_size` input features
(-1: one group per output channel) stores:
- `X.qweight` int32 `[in * bits / 32, out]`: the unsigned codes packed along the input dimension,
  `32 / bits` to a word, code of input `i` at bit `bits * (i % (32 / bits))` of row `i // (32 / bits)`.
- `X.qzeros` int32 `[groups, out * bits / 32]`: the zero points packed the same way along the output
  dimension. `checkpoint_format` "gptq" (v1, AutoGPTQ's) stores each zero point minus one; "gptq_v2"
  (GPTQModel's own) stores it as is.
- `X.scales` `[groups, out]` float16; `X.g_idx` int32 `[in]`: the group of each input feature.
A weight decodes as `(q - zero) * scale`. Activation order (`desc_act`) permutes `g_idx`; quantlab's
groups are contiguous runs of input features, so only a `g_idx` of `i // group_size` is read.
"""

from dataclasses import dataclass
from typing import Any

import torch

from quantlab.formats.codec import IntegerGrid
from quantlab.interop.compressed_tensors import Scheme, unpack_int32
from quantlab.interop.errors import ForeignCheckpointError

QUANT_METHOD = "gptq"
BITS = (2, 4, 8)  # the widths whose codes fill an int32 word exactly
FORMATS = {"gptq": 1, "gptq_v2": 2}
QWEIGHT, QZEROS, SCALES, GROUP_INDEX = "qweight", "qzeros", "scales", "g_idx"
LAYER_TENSORS = (QWEIGHT, QZEROS, SCALES, GROUP_INDEX)


class GPTQFormatError(ForeignCheckpointError):
    """A GPTQ checkpoint quantlab cannot read exactly; the message says why."""


@dataclass(frozen=True)
class GPTQConfig:
    """What a GPTQ `quantization_config` says about every layer."""

    bits: int
    group_size: int | None
    symmetric: bool
    version: int

    @classmethod
    def read(cls, config: dict[str, Any]) -> "GPTQConfig":
        bits = config.get("bits")
        if bits not in BITS:
            raise GPTQFormatError(
                f"{bits}-bit GPTQ codes do not fill 32-bit words evenly; quantlab reads "
                f"{', '.join(map(str, BITS))} bits"
            )
        fmt = config.get("checkpoint_format") or "gptq"
        if fmt not in FORMATS:
            raise GPTQFormatError(
                f"GPTQ checkpoint_format {fmt!r} repacks codes for one kernel; quantlab reads {', '.join(FORMATS)}"
            )
        group_size = config.get("group_size", 128)
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise GPTQFormatError(f"GPTQ group_size={group_size!r} is not a positive number or -1 (per channel)")
        return cls(bits, None if group_size == -1 else group_size, bool(config.get("sym", True)), FORMATS[fmt])

    @property
    def scheme(self) -> Scheme:
        return Scheme(self.bits, self.group_size, self.symmetric)


def read_layer(tensors: dict[str, torch.Tensor], config: GPTQConfig, where: str) -> IntegerGrid:
    """A layer's GPTQ tensors → its integer grid (codes and zero points unsigned, scales as stored)."""
    missing = [name for name in (QWEIGHT, QZEROS, SCALES) if name not in tensors]
    if missing:
        raise GPTQFormatError(f"{where}: {', '.join(missing)} missing from the checkpoint")
    qweight, scales = tensors[QWEIGHT], tensors[SCALES]
    groups, out = scales.shape
    cols = qweight.shape[0] * 32 // config.bits
    if qweight.shape[1] != out:
        raise GPTQFormatError(f"{where}: qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} disagree")
    group = config.group_size or cols
    if cols % group or cols // group != groups:
        raise GPTQFormatError(f"{where}: {cols} input features in groups of {group} are not the {groups} scale rows")
    if tuple(tensors[QZEROS].shape) != (groups, out * config.bits // 32):
        raise GPTQFormatError(
            f"{where}: qzeros {tuple(tensors[QZEROS].shape)} do not pack {groups} x {out} zero points"
        )
    _check_group_index(tensors.get(GROUP_INDEX), group, cols, where)
    codes = unpack_int32(qweight.t().contiguous(), config.bits, cols)
    zero = unpack_int32(tensors[QZEROS], config.bits, out).t().to(torch.int16)
    if config.version == 1:
        zero = zero + 1
    top = (1 << config.bits) - 1
    if int(zero.max()) > top:
        raise GPTQFormatError(
            f"{where}: a zero point of {int(zero.max())} lies outside the {config.bits}-bit codes (0 to {top})"
        )
    if config.symmetric:
        midpoint = 1 << (config.bits - 1)
        if not bool((zero == midpoint).all()):
            raise GPTQFormatError(f"{where}: sym=true, but its zero points are not all {midpoint}")
        return IntegerGrid(config.bits, config.group_size, codes, scales.t().contiguous())
    return IntegerGrid(config.bits, config.group_size, codes, scales.t().contiguous(), zero.to(torch.uint8))


def _check_group_index(index: torch.Tensor | None, group: int, cols: int, where: str) -> None:
    if index is None:
        return
    if not torch.equal(index.long(), torch.arange(cols) // group):
        raise GPTQFormatError(
            f"{where}: its g_idx puts input features in groups out of order (act-order, desc_act); quantlab's "
            f"groups are contiguous, so re-quantize without desc_act (or with static_groups)"
        )
