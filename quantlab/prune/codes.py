"""How a quantized layer's `weight` buffer holds one integer code per weight, for sparse storage.

Sparse storage of a pruned-then-quantized layer keeps only the codes of live weights. To find
them it needs the codes one per weight, grouped as the layer groups weights
(`[out, groups, group_size]`), and to write them back it needs the inverse. A `CodeLayout`
says that; it is read off the layer's storage layout (`layer.layout`: codec, bits, group
size), so every layer declaring a built-in codec, a plugin's too, is stored sparse with nothing
registered. The `CodeLayout` is also written into the sparse file, which decodes without the
layer. A layer that declares no storage layout is stored as it is (correct, just not smaller).
"""

import dataclasses

import torch

from quantlab.formats import packing
from quantlab.kernels import quantize as quantize_ops
from quantlab.nn import QuantizedLinear
from quantlab.nn.layouts import declared_layout

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
        return quantize_ops.pack(codes, self.bits)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def code_layout(layer: QuantizedLinear) -> CodeLayout | None:
    """How `layer` stores its codes, from its storage layout; None when it declares none."""
    layout = declared_layout(layer)
    if layout is None:
        return None
    return CodeLayout("packed" if layout.packed else "int8", layout.bits, layout.group_length)
