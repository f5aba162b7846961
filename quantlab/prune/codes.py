"""How a quantized layer's `weight` buffer holds one integer code per weight, for sparse storage.

Sparse storage of a pruned-then-quantized layer keeps only the codes of live weights. To find
them it needs the codes one per weight, grouped as the layer groups weights
(`[out, groups, group_size]`), and to write them back it needs the inverse. A `CodeLayout`
says that; it is read off the layer's storage layout (`layer.layout`: whether its codec packs
codes, bits, group size), so every layer declaring a layout, of any registered codec, is stored
sparse with nothing else registered. The `CodeLayout` is also written into the sparse file, which
decodes without the layer. A layer that declares no storage layout is stored as it is (correct,
just not smaller).
"""

import dataclasses

import torch

from quantlab.formats import fast_path, packing
from quantlab.nn import QuantizedLinear
from quantlab.nn.layouts import declared_layout

BYTE, PACKED = "int8", "packed"
CODE_STORAGE = (BYTE, PACKED)


@dataclasses.dataclass(frozen=True)
class CodeLayout:
    """How `weight` holds the codes (the field is named `codec` in sparse files): "int8", one byte per
    code; "packed", `bits`-bit codes packed by `quantlab.formats.packing`."""

    codec: str
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.codec not in CODE_STORAGE:
            raise ValueError(f"code storage {self.codec!r} is not one of {CODE_STORAGE}")

    def unpack(self, stored: torch.Tensor) -> torch.Tensor:
        """The layer's `weight` buffer → unsigned codes `[out, groups, group_size]`."""
        if self.codec == BYTE:
            return stored.view(torch.uint8)
        return packing.unpack(stored, self.bits, self.group_size)

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Unsigned codes `[out, groups, group_size]` → the layer's `weight` buffer."""
        if self.codec == BYTE:
            return codes.to(torch.uint8).view(torch.int8)
        return fast_path.pack(codes, self.bits)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def code_layout(layer: QuantizedLinear) -> CodeLayout | None:
    """How `layer` stores its codes, from its storage layout; None when it declares none."""
    layout = declared_layout(layer)
    if layout is None:
        return None
    return CodeLayout(PACKED if layout.packed else BYTE, layout.bits, layout.group_length)
