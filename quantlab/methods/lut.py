"""Learned non-uniform grids: each layer's own table of 2**bits levels times a scale per group.

The `lut` codec (`quantlab.formats.learned_table`) fits the table by weighted k-means before
the solver chooses codes: with calibration data each input channel counts by its `E[x^2]`, and
GPTQ then chooses the codes on the fitted table. A weight costs `bits` plus 16/`group_size` bits
(float16 scales) plus the table, `16 * 2**bits` bits per layer. The layers run on the native
kernels' table path and export to ONNX as a table lookup.
"""

import dataclasses

from quantlab.config import SCALE_DTYPES, QuantlabConfig, check_choice, check_group_size
from quantlab.errors import ConfigError
from quantlab.formats import learned_table
from quantlab.formats.layout import StorageLayout
from quantlab.formats.learned_table import LUT
from quantlab.methods.custom_bits import ALLOCATION_GROUP_SIZES
from quantlab.nn import QuantizedLinear


@dataclasses.dataclass(repr=False)
class LutConfig(QuantlabConfig):
    """A learned table of 2**`bits` levels per layer (`bits` 2-4) times a scale per group of `group_size`.

    With `target_bits`, mixed precision gives each layer its own width (2-4) and group size (32-128);
    its measurement pass predicts each candidate's error on the normal-quantile starting table (fitting a
    table per candidate and layer would cost minutes a layer), the table is then fitted to the choice."""

    method = "lut"

    bits: int = dataclasses.field(default=4, metadata={"help": "2, 3 or 4: a table of 4, 8 or 16 levels per layer"})
    group_size: int | None = 64
    scale_dtype: str = "float16"

    def allocation_candidates(self) -> list[dict]:
        """Tables of 4, 8 and 16 levels at groups of 32, 64 and 128 (each row of this list a layer's choice)."""
        return [{"bits": b, "group_size": g} for b in learned_table.BITS for g in ALLOCATION_GROUP_SIZES]

    def validate(self) -> None:
        if self.bits not in learned_table.BITS:
            raise ConfigError(f"{self.method}: bits={self.bits!r} is not valid; use 2, 3 or 4")
        check_group_size(self.method, "group_size", self.group_size, 32, 256)
        check_choice(self.method, "scale_dtype", self.scale_dtype, SCALE_DTYPES)


class LutLinear(QuantizedLinear):
    """The table fitted to the weight alone, then round to nearest (`QuantizedLinear.quantize_weight`)."""

    config_class = LutConfig

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: LutConfig) -> StorageLayout:
        return StorageLayout(
            LUT.name,
            config.bits,
            config.group_size,
            in_features,
            out_features,
            scale_dtype=SCALE_DTYPES[config.scale_dtype],
        )
