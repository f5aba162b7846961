"""The `int8` codec: symmetric 8-bit codes stored as signed bytes, one per weight.

`w ≈ q * scale`, `q` in [-127, 127], `scale = absmax / 127` per group (or per output channel).
The grid is the 8-bit symmetric affine grid (unsigned code `q + 128`, zero point 128), so
fitting, rounding and the zero-scale rule are the affine codec's; only the stored codes differ:
`weight` holds `q` itself as int8, the layout `torch.int8` matmuls and onnxruntime expect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quantlab.formats import fast_path
from quantlab.formats.affine import AffineCodec
from quantlab.formats.codec import NoOptions, TensorSpec, register_codec

if TYPE_CHECKING:
    from quantlab.formats.layout import Descriptor, StorageLayout

BITS = 8


class Int8Codec(AffineCodec):
    name = "int8"
    native_kind = 1  # QL_INT8
    packed_codes = False
    options_type = NoOptions  # always symmetric: no option of the affine codec's applies

    def validate(self, layout: StorageLayout) -> None:
        if layout.bits != BITS:
            raise ValueError(f"the int8 codec stores 8-bit codes, got bits={layout.bits}")

    def tensors(self, layout: StorageLayout) -> dict[str, TensorSpec]:
        out, groups = layout.out_features, layout.groups
        return {
            "weight": TensorSpec((out, groups, layout.group_length), torch.int8),
            "weight_scale": TensorSpec((out, groups), layout.scale_dtype),
        }

    def descriptor(self, layout: StorageLayout) -> str:
        return super(AffineCodec, self).descriptor(layout)  # the zero point 128 is implied by the kind

    def has_zero(self, layout: StorageLayout) -> bool:
        return False

    def stored_codes(self, layout: StorageLayout, codes: torch.Tensor) -> torch.Tensor:
        return fast_path.offset_to_signed(codes)

    def codes(self, layout: StorageLayout, weight: torch.Tensor) -> torch.Tensor:
        return (weight.to(torch.int16) + fast_path.INT8_OFFSET).to(torch.uint8)

    def label(self, layout: StorageLayout) -> str:
        return self.name

    def int8_activations(self, descriptor: Descriptor) -> bool:
        """Groups of 64 or a multiple (a per-channel group being the row)."""
        return descriptor.group_size % 64 == 0


INT8 = register_codec(Int8Codec())
