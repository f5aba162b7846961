"""NF4 with optional double quantization (QLoRA, arXiv 2305.14314).

At blocksize 64 with double quantization a weight costs 4 + 8/64 + 32/(64*256) ≈ 4.127 bits.
The 4-bit codes equal those of `bitsandbytes.functional.quantize_4bit(quant_type="nf4")`.
"""

import dataclasses

from quantlab.config import QuantlabConfig, check_group_size
from quantlab.formats import nf4
from quantlab.formats.layout import StorageLayout
from quantlab.formats.nf4 import NF4, NF4Options
from quantlab.nn import QuantizedLinear


@dataclasses.dataclass(repr=False)
class NF4Config(QuantlabConfig):
    """NormalFloat-4 in blocks of `blocksize`; `double_quant` stores each block's absmax in 8 bits."""

    method = "nf4"

    blocksize: int = 64
    double_quant: bool = True

    def validate(self) -> None:
        check_group_size(self.method, "blocksize", self.blocksize, 16, 4096)


class NF4Linear(QuantizedLinear):
    """Round to nearest by the nf4 codec (`QuantizedLinear.quantize_weight`)."""

    config_class = NF4Config

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: NF4Config) -> StorageLayout:
        return StorageLayout(
            NF4.name,
            nf4.BITS,
            config.blocksize,
            in_features,
            out_features,
            options=NF4Options(double_quant=config.double_quant),
        )
