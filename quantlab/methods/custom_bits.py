"""Integer quantization at any width from 2 to 8 bits, group-wise, with or without zero points.

Round-to-nearest on groups of `group_size` weights along the input dimension (or one group
per output channel). Codes are bit-packed, so the checkpoint stores exactly `bits` bits per
weight plus one scale (and one zero point when asymmetric) per group.
"""

import dataclasses

from quantlab.config import SCALE_DTYPES, QuantlabConfig, check_choice, check_group_size
from quantlab.errors import ConfigError
from quantlab.formats.affine import AFFINE, AffineOptions
from quantlab.formats.layout import StorageLayout
from quantlab.nn import QuantizedLinear

MIN_BITS, MAX_BITS = 2, 8
# What mixed precision (`target_bits`) chooses from for each layer.
ALLOCATION_BITS = (2, 3, 4, 5, 6, 8)
ALLOCATION_GROUP_SIZES = (32, 64, 128)
ALLOCATION_SYMMETRY = (True, False)  # a zero point per group is often worth more than a wider code at 3 bits


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

    def allocation_candidates(self) -> list[dict]:
        """Widths 2-8 at group sizes 32-128, each with and without zero points, at this config's scale dtype."""
        return [
            {"bits": b, "group_size": g, "symmetric": s}
            for b in ALLOCATION_BITS
            for g in ALLOCATION_GROUP_SIZES
            for s in ALLOCATION_SYMMETRY
        ]


class CustomBitsLinear(QuantizedLinear):
    """Round to nearest by the affine codec (`QuantizedLinear.quantize_weight`)."""

    config_class = CustomBitsConfig

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: CustomBitsConfig) -> StorageLayout:
        return StorageLayout(
            AFFINE.name,
            config.bits,
            config.group_size,
            in_features,
            out_features,
            scale_dtype=SCALE_DTYPES[config.scale_dtype],
            options=AffineOptions(symmetric=config.symmetric),
        )
