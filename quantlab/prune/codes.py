"""How a quantized layer's `weight` buffer holds one integer code per weight, for sparse storage.

Sparse storage of a pruned-then-quantized layer keeps only the codes of live weights. To find
them it needs the codes one per weight, grouped as the method groups weights
(`[out, groups, group_size]`), and to write them back it needs the inverse. Each quantized
layer class maps to a `CodeLayout` saying that; methods registered here are the built-in ones,
and a plugin adds its own with `register_code_layout`. A layer without a layout is stored as
it is (correct, just not smaller).
"""

import dataclasses
from collections.abc import Callable

import torch

from quantlab.formats import grouping, packing
from quantlab.nn import QuantizedLinear

CODECS = ("int8", "packed")


@dataclasses.dataclass(frozen=True)
class CodeLayout:
    """`codec` "int8": one signed byte per code; "packed": `bits`-bit codes packed by `quantlab.formats.packing`."""

    codec: str
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"codec {self.codec!r} is not one of {CODECS}")

    def unpack(self, stored: torch.Tensor) -> torch.Tensor:
        """The layer's `weight` buffer → unsigned codes `[out, groups, group_size]`."""
        if self.codec == "int8":
            return stored.view(torch.uint8)
        return packing.unpack(stored, self.bits, self.group_size)

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Unsigned codes `[out, groups, group_size]` → the layer's `weight` buffer."""
        if self.codec == "int8":
            return codes.to(torch.uint8).view(torch.int8)
        return packing.pack(codes, self.bits)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


LayoutOf = Callable[[QuantizedLinear], CodeLayout]
_LAYOUTS: dict[type, LayoutOf] = {}


def register_code_layout(module_class: type[QuantizedLinear], layout_of: LayoutOf) -> None:
    """Tell sparse storage how `module_class` stores its codes (`layout_of(layer) -> CodeLayout`)."""
    _LAYOUTS[module_class] = layout_of


def code_layout(layer: QuantizedLinear) -> CodeLayout | None:
    for cls in type(layer).__mro__:
        if cls in _LAYOUTS:
            return _LAYOUTS[cls](layer)
    return None


def _register_builtin() -> None:
    from quantlab.methods.custom_bits import CustomBitsLinear
    from quantlab.methods.int8 import Int8Linear
    from quantlab.methods.nf4 import NF4Linear

    def group_size(layer: QuantizedLinear, size: int | None) -> int:
        return grouping.effective_group_size(layer.in_features, size)

    register_code_layout(Int8Linear, lambda layer: CodeLayout("int8", 8, group_size(layer, layer.config.group_size)))
    register_code_layout(NF4Linear, lambda layer: CodeLayout("packed", 4, layer.config.blocksize))
    register_code_layout(
        CustomBitsLinear,
        lambda layer: CodeLayout("packed", layer.config.bits, group_size(layer, layer.config.group_size)),
    )


_register_builtin()
