"""Integer quantization at any width from 2 to 8 bits, group-wise, with or without zero points.

Round-to-nearest on groups of `group_size` weights along the input dimension (or one group
per output channel). Codes are bit-packed, so the checkpoint stores exactly `bits` bits per
weight plus one scale (and one zero point when asymmetric) per group.
"""

import dataclasses

import torch

from quantlab.config import SCALE_DTYPES, QuantlabConfig, check_choice, check_group_size
from quantlab.errors import ConfigError
from quantlab.formats import affine, grouping, packing
from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_linear import StorageSpec

MIN_BITS, MAX_BITS = 2, 8


@dataclasses.dataclass(repr=False)
class CustomBitsConfig(QuantlabConfig):
    """`bits` from 2 to 8; `group_size` a power of two from 32 to 256, or None (per channel)."""

    method = "custom_bits"

    bits: int = 4
    group_size: int | None = 64
    symmetric: bool = False
    scale_dtype: str = "float16"

    def validate(self) -> None:
        if not isinstance(self.bits, int) or not MIN_BITS <= self.bits <= MAX_BITS:
            raise ConfigError(
                f"{self.method}: bits={self.bits!r} is not valid; use a whole number from {MIN_BITS} to {MAX_BITS}"
            )
        check_group_size(self.method, "group_size", self.group_size, 32, 256)
        check_choice(self.method, "scale_dtype", self.scale_dtype, SCALE_DTYPES)
        if not isinstance(self.symmetric, bool):
            raise ConfigError(f"{self.method}: symmetric={self.symmetric!r} is not valid; use true or false")


class CustomBitsLinear(QuantizedLinear):
    config_class = CustomBitsConfig

    @property
    def format(self) -> str:
        return f"uint{self.config.bits}" + ("_sym" if self.config.symmetric else "_asym")

    @classmethod
    def storage_spec(cls, in_features: int, out_features: int, config: CustomBitsConfig) -> StorageSpec:
        groups = grouping.num_groups(in_features, config.group_size)
        size = grouping.effective_group_size(in_features, config.group_size)
        scale_dtype = SCALE_DTYPES[config.scale_dtype]
        spec: StorageSpec = {
            "weight": ((out_features, groups, packing.packed_size(size, config.bits)), torch.uint8),
            "weight_scale": ((out_features, groups), scale_dtype),
        }
        if not config.symmetric:
            spec["weight_zero"] = ((out_features, groups), scale_dtype)
        return spec

    @classmethod
    def quantize_weight(cls, weight: torch.Tensor, config: CustomBitsConfig) -> dict[str, torch.Tensor]:
        scale_dtype = SCALE_DTYPES[config.scale_dtype]
        quantized = affine.quantize(weight, config.bits, config.group_size, config.symmetric, scale_dtype)
        stored = {"weight": packing.pack(quantized.codes, config.bits), "weight_scale": quantized.scale}
        if quantized.zero is not None:
            stored["weight_zero"] = quantized.zero
        return stored

    def codes(self) -> torch.Tensor:
        """Unpacked codes `[out, groups, group_size]`."""
        size = grouping.effective_group_size(self.in_features, self.config.group_size)
        return packing.unpack(self.weight, self.config.bits, size)

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        zero = getattr(self, "weight_zero", None)
        return affine.dequantize(self.codes(), self.weight_scale, zero, self.config.bits, self.in_features, dtype)
