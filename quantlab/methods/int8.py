"""Int8 symmetric weight-only quantization (absmax per output channel, or per group).

`w ≈ q * scale`, `q` in [-127, 127], `scale = absmax / 127`: the error of each weight is at
most `scale / 2`. Codes are stored as int8, one byte per weight.
"""

import dataclasses

import torch

from quantlab.config import SCALE_DTYPES, QuantlabConfig, check_choice, check_group_size
from quantlab.formats import affine, grouping
from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_linear import StorageSpec

_SIGNED_OFFSET = 128


@dataclasses.dataclass(repr=False)
class Int8SymmetricConfig(QuantlabConfig):
    """int8 codes with absmax scales per output channel (`group_size=None`) or per group."""

    method = "int8"

    group_size: int | None = None
    scale_dtype: str = "float32"

    def validate(self) -> None:
        check_group_size(self.method, "group_size", self.group_size, 32, 4096)
        check_choice(self.method, "scale_dtype", self.scale_dtype, SCALE_DTYPES)


class Int8Linear(QuantizedLinear):
    config_class = Int8SymmetricConfig

    @property
    def format(self) -> str:
        return "int8"

    @classmethod
    def storage_spec(cls, in_features: int, out_features: int, config: Int8SymmetricConfig) -> StorageSpec:
        groups = grouping.num_groups(in_features, config.group_size)
        size = grouping.effective_group_size(in_features, config.group_size)
        return {
            "weight": ((out_features, groups, size), torch.int8),
            "weight_scale": ((out_features, groups), SCALE_DTYPES[config.scale_dtype]),
        }

    @classmethod
    def quantize_weight(cls, weight: torch.Tensor, config: Int8SymmetricConfig) -> dict[str, torch.Tensor]:
        quantized = affine.quantize(weight, 8, config.group_size, True, SCALE_DTYPES[config.scale_dtype])
        codes = (quantized.codes.to(torch.int16) - _SIGNED_OFFSET).to(torch.int8)
        return {"weight": codes, "weight_scale": quantized.scale}

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = self.weight.float() * self.weight_scale.float().unsqueeze(-1)
        return grouping.ungroup(values, self.in_features).to(dtype)
