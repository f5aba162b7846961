"""Int8 symmetric weight-only quantization (absmax per output channel, or per group).

`w ≈ q * scale`, `q` in [-127, 127], `scale = absmax / 127`: the error of each weight is at
most `scale / 2`. Codes are stored as int8, one byte per weight.
"""

import dataclasses

from quantlab.config import SCALE_DTYPES, QuantlabConfig, check_choice, check_group_size
from quantlab.formats.int8 import INT8
from quantlab.formats.layout import StorageLayout
from quantlab.nn import QuantizedLinear


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
    """Round to nearest by the int8 codec (`QuantizedLinear.quantize_weight`)."""

    config_class = Int8SymmetricConfig

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: Int8SymmetricConfig) -> StorageLayout:
        return StorageLayout(
            INT8.name, 8, config.group_size, in_features, out_features, scale_dtype=SCALE_DTYPES[config.scale_dtype]
        )
