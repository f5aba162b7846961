"""NF4 with optional double quantization (QLoRA, arXiv 2305.14314).

At blocksize 64 with double quantization a weight costs 4 + 8/64 + 32/(64*256) ≈ 4.127 bits.
The 4-bit codes equal those of `bitsandbytes.functional.quantize_4bit(quant_type="nf4")`.
"""

import dataclasses

import torch

from quantlab.config import QuantlabConfig, check_group_size
from quantlab.formats.layout import StorageLayout
from quantlab.kernels import quantize as rounding
from quantlab.nn import QuantizedLinear

_BITS = 4


@dataclasses.dataclass(repr=False)
class NF4Config(QuantlabConfig):
    """NormalFloat-4 in blocks of `blocksize`; `double_quant` stores each block's absmax in 8 bits."""

    method = "nf4"

    blocksize: int = 64
    double_quant: bool = True

    def validate(self) -> None:
        check_group_size(self.method, "blocksize", self.blocksize, 16, 4096)


class NF4Linear(QuantizedLinear):
    config_class = NF4Config

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: NF4Config) -> StorageLayout:
        return StorageLayout(
            "nf4", _BITS, config.blocksize, in_features, out_features, double_quant=config.double_quant
        )

    @classmethod
    def quantize_weight(cls, weight: torch.Tensor, config: NF4Config) -> dict[str, torch.Tensor]:
        quantized = rounding.nf4_quantize(weight, config.blocksize, config.double_quant)
        stored = {"weight": rounding.pack(quantized.codes, _BITS)}
        if config.double_quant:
            stored["weight_absmax_codes"] = quantized.absmax_codes
            stored["weight_absmax_scale"] = quantized.absmax_scale
            stored["weight_absmax_offset"] = quantized.absmax_offset
        else:
            stored["weight_absmax"] = quantized.absmax
        return stored
