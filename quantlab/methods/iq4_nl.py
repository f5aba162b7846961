"""llama.cpp's IQ4_NL: 4-bit indices into a fixed non-uniform table of 16 levels, one float16 scale per group.

A weight costs 4 + 16/32 = 4.5 bits at group size 32 (4.25 at 64). The layers run on quantlab's
native kernels and export to GGUF as IQ4_NL blocks exactly (group sizes that are multiples of 32
along rows of a multiple of 32), so the codes GPTQ chooses are the ones llama.cpp computes with.
"""

import dataclasses

import torch

from quantlab.config import QuantlabConfig, check_group_size
from quantlab.errors import ConfigError
from quantlab.formats import iq4_nl
from quantlab.formats.iq4_nl import IQ4_NL
from quantlab.formats.layout import StorageLayout
from quantlab.nn import QuantizedLinear


@dataclasses.dataclass(repr=False)
class IQ4NLConfig(QuantlabConfig):
    """IQ4_NL: llama.cpp's 16-level non-uniform table times a float16 scale per group of `group_size`."""

    method = "iq4_nl"

    group_size: int = dataclasses.field(
        default=32, metadata={"help": "weights per float16 scale (32 is a GGUF IQ4_NL block; 64-256 export too)"}
    )

    def validate(self) -> None:
        if self.group_size is None:
            raise ConfigError(f"{self.method}: group_size=None is not valid; use a power of two from 32 to 256")
        check_group_size(self.method, "group_size", self.group_size, 32, 256)


class IQ4NLLinear(QuantizedLinear):
    """Round to nearest with a small scale search by the iq4_nl codec (`QuantizedLinear.quantize_weight`)."""

    config_class = IQ4NLConfig

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: IQ4NLConfig) -> StorageLayout:
        return StorageLayout(
            IQ4_NL.name, iq4_nl.BITS, config.group_size, in_features, out_features, scale_dtype=torch.float16
        )
