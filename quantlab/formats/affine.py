"""The `affine` codec: group-wise integer codes of 1 to 8 bits, with or without zero points.

Symmetric (no stored zero point): `w ≈ (q - 2**(b-1)) * scale`, `scale = absmax / (2**(b-1) - 1)`,
so zero is exact. Asymmetric: `w ≈ (q - zero) * scale`, `scale = (max - min) / (2**b - 1)`,
`zero = -min / scale` kept as a float in the scale dtype (no rounding of the zero point, the
layout of onnxruntime's MatMulNBits). Codes are unsigned `0 <= q < 2**b`, packed `b` bits to
the byte; the dequantization error of each weight is at most `scale / 2`.

Scales (and zero points) are cast to their storage dtype before the codes are computed, so
codes are chosen against the numbers that are kept. A group whose scale is zero in that dtype
(a constant group, or one whose scale underflows) gets scale 1, and zero point `-min`: its
weights are then exact. That rule is `AffineCodec.grid`; every writer of affine grids uses it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from quantlab.formats import fast_path, grouping, packing
from quantlab.formats.codec import (
    GGUF_BLOCK,
    Codec,
    GGUFBlocks,
    GroupParams,
    IntegerGrid,
    NotAnIntegerGrid,
    NotExactInGGUF,
    TensorSpec,
    float16_exact,
    per_block,
    register_codec,
)

if TYPE_CHECKING:
    from quantlab.formats.layout import Descriptor, StorageLayout


@dataclasses.dataclass(frozen=True)
class AffineOptions:
    """`symmetric`: no stored zero point, the constant `2**(bits-1)` instead."""

    symmetric: bool = True


class AffineCodec(Codec):
    name = "affine"
    native_kind = 0  # QL_AFFINE
    onnx_lowering = "integer-grid"
    options_type = AffineOptions

    def tensors(self, layout: StorageLayout) -> dict[str, TensorSpec]:
        out, groups = layout.out_features, layout.groups
        code_bytes = packing.packed_size(layout.group_length, layout.bits)
        specs = {
            "weight": TensorSpec((out, groups, code_bytes), torch.uint8),
            "weight_scale": TensorSpec((out, groups), layout.scale_dtype),
        }
        if self.has_zero(layout):
            specs["weight_zero"] = TensorSpec((out, groups), layout.scale_dtype)
        return specs

    def descriptor(self, layout: StorageLayout) -> str:
        text = super().descriptor(layout)
        return text if self.has_zero(layout) else f"{text} zero={self.constant_zero(layout):g}"

    def native_arguments(self, layout: StorageLayout) -> tuple[str | None, ...]:
        return ("weight_scale", "weight_zero") if self.has_zero(layout) else ("weight_scale",)

    # -- round to nearest -----------------------------------------------------------------------

    def quantize(self, layout: StorageLayout, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Round-to-nearest on each group's min-max (absmax when symmetric) grid; a registered
        `affine_quantize` op computes the same bits in one pass."""
        symmetric = not self.has_zero(layout)
        native = fast_path.run(
            "affine_quantize", weight, weight, layout.bits, layout.group_size, symmetric, layout.scale_dtype
        )
        if native is None:
            return super().quantize(layout, weight)
        codes, scale, zero = native
        return self.store(layout, codes, GroupParams(scale=scale, zero=zero))

    # -- the grid -------------------------------------------------------------------------------

    def has_zero(self, layout: StorageLayout) -> bool:
        return not layout.options.symmetric

    def constant_zero(self, layout: StorageLayout) -> float:
        return float(1 << (layout.bits - 1))

    def signed_grids(self, layout: StorageLayout) -> bool:
        return not self.has_zero(layout)

    def fit(
        self, layout: StorageLayout, grouped: torch.Tensor, clip: torch.Tensor | float = 1.0, signed: bool = False
    ) -> GroupParams:
        grouped = grouped.float()
        clip = torch.as_tensor(clip, dtype=torch.float32, device=grouped.device)
        if not self.has_zero(layout):
            if signed:
                extreme = grouped.gather(-1, grouped.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
                return self.grid(layout, -extreme * clip / self.constant_zero(layout))
            qmax = (1 << (layout.bits - 1)) - 1
            return self.grid(layout, grouped.abs().amax(dim=-1) * clip / qmax)
        low = grouped.amin(dim=-1) * clip
        high = grouped.amax(dim=-1) * clip
        return self.grid(layout, (high - low) / layout.max_code, low=low)

    def grid(
        self,
        layout: StorageLayout,
        scale: torch.Tensor,
        zero: torch.Tensor | None = None,
        low: torch.Tensor | None = None,
    ) -> GroupParams:
        """Grids `[out, groups]` from float scales (and zero points), as stored.

        With `low` (each group's smallest weight) and no `zero`, the zero point is fitted to the
        stored scale, `-low / scale`. A scale that is zero in the scale dtype becomes 1, and with
        `low` given the group's zero point becomes `-low`: a constant group is then exact.
        """
        stored = scale.to(layout.scale_dtype)
        unit = stored == 0
        scale = torch.where(unit, torch.ones_like(stored), stored).float()
        if not self.has_zero(layout):
            return GroupParams(scale=scale)
        if zero is None:
            zero = -low / scale
        elif low is not None:
            zero = torch.where(unit, -low, zero)
        return GroupParams(scale=scale, zero=zero.to(layout.scale_dtype).float())

    def encode(
        self, layout: StorageLayout, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> torch.Tensor:
        if zero is None:  # an integer zero point: added after rounding, so the sum is exact
            target = torch.round(values.float() / scale.float()) + self.constant_zero(layout)
        else:
            target = torch.round(values.float() / scale.float() + zero.float())
        return target.clamp_(0, layout.max_code).to(torch.uint8)

    def decode(
        self, layout: StorageLayout, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> torch.Tensor:
        return (codes.float() - (zero.float() if zero is not None else self.constant_zero(layout))) * scale.float()

    def round_trip(
        self, layout: StorageLayout, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # `encode` then `decode` without the uint8 codes between them: the same integers in float32.
        scale = scale.float()
        if zero is None:  # clamping the rounded value to [-c, max - c] is clamping its code to [0, max]
            offset = self.constant_zero(layout)
            rounded = torch.round(values.float() / scale).clamp_(-offset, layout.max_code - offset)
            return rounded * scale, rounded.add_(offset)
        zero = zero.float()
        level = torch.round(values.float() / scale + zero).clamp_(0, layout.max_code)
        return (level - zero) * scale, level

    # -- stored tensors -------------------------------------------------------------------------

    def store(self, layout: StorageLayout, codes: torch.Tensor, params: GroupParams) -> dict[str, torch.Tensor]:
        stored = {"weight": self.stored_codes(layout, codes), "weight_scale": params.scale.to(layout.scale_dtype)}
        if self.has_zero(layout):
            stored["weight_zero"] = params.zero.to(layout.scale_dtype)
        return stored

    def stored_codes(self, layout: StorageLayout, codes: torch.Tensor) -> torch.Tensor:
        """Unsigned codes `[out, groups, length]` → the `weight` buffer."""
        return fast_path.pack(codes.to(torch.uint8), layout.bits)

    def codes(self, layout: StorageLayout, weight: torch.Tensor) -> torch.Tensor:
        return packing.unpack(weight, layout.bits, layout.group_length)

    def params(self, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> GroupParams:
        zero = stored["weight_zero"].float() if self.has_zero(layout) else None
        return GroupParams(scale=stored["weight_scale"].float(), zero=zero)

    # -- what other parts of quantlab ask ---------------------------------------------------------

    def label(self, layout: StorageLayout) -> str:
        return f"{self.name}-asym" if self.has_zero(layout) else f"{self.name}-sym"

    def int8_activations(self, descriptor: Descriptor) -> bool:
        """4-bit codes in groups of 64 or a multiple (a per-channel group being the row)."""
        return descriptor.bits == 4 and descriptor.group_size % 64 == 0

    # -- GGUF -------------------------------------------------------------------------------------

    def gguf_type(self, layout: StorageLayout) -> str | None:
        """Symmetric codes `q - 2**(b-1)` are the signed codes of Q4_0 (up to 4 bits) or Q8_0 (up to 8);
        with zero points, codes of up to 4 bits are Q4_1's, `m = -zero * scale`."""
        if self.has_zero(layout):
            return "Q4_1" if layout.bits <= 4 else None
        return "Q4_0" if layout.bits <= 4 else "Q8_0"

    def gguf_blocks(self, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> GGUFBlocks:
        kind = self.gguf_type(layout)
        if kind is None:
            raise NotExactInGGUF(
                f"{layout.bits}-bit codes with zero points have no GGUF type (Q4_1, the one with a minimum per "
                f"block, holds 4 bits)"
            )
        codes, params = self.load(layout, stored)
        codes = grouping.ungroup(codes, layout.in_features)
        scale = float16_exact(per_block(params.scale, layout), "a scale")
        if kind == "Q4_1":
            return self._gguf_q4_1(layout, stored, codes, scale, per_block(params.zero, layout))
        signed = codes.to(torch.int16) - int(self.constant_zero(layout))
        if kind == "Q4_0":
            return GGUFBlocks(kind, (signed + 8).to(torch.uint8), scale)
        return GGUFBlocks(kind, signed.to(torch.int8), scale)

    def _gguf_q4_1(
        self,
        layout: StorageLayout,
        stored: dict[str, torch.Tensor],
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
    ) -> GGUFBlocks:
        """`(q - zero) * scale` as `q * d + m`: `m = -zero * scale` must be a float16 number (the product
        is exact in float64), and the two float32 evaluations must round alike, which is checked."""
        minimum = float16_exact(-(zero.double() * scale.double()), "a group's minimum -zero * scale")
        blocks = GGUFBlocks("Q4_1", codes, scale, minimum)
        expanded = codes.float().reshape(codes.shape[0], -1, GGUF_BLOCK)
        decoded = (expanded * scale.float().unsqueeze(-1) + minimum.float().unsqueeze(-1)).reshape(codes.shape)
        if not torch.equal(decoded, self.dequantize(layout, stored)):
            raise NotExactInGGUF("q * d + m rounds differently from (q - zero) * scale in float32 for some weights")
        return blocks

    # -- integer grids (compressed-tensors, GPTQ) -------------------------------------------------

    def integer_grid(self, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> IntegerGrid:
        """Codes and scales as stored; a stored zero point must be a whole number in the code range
        (round-to-nearest fits a fractional one, `-min / scale`: such layers are no integer grid)."""
        _whole_groups(layout)
        codes = grouping.ungroup(self.codes(layout, stored["weight"]), layout.in_features)
        zero = None
        if self.has_zero(layout):
            zero = stored["weight_zero"].double()
            bad = (zero != zero.round()) | (zero < 0) | (zero > layout.max_code)
            if bad.any():
                value = zero.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]].item()
                raise NotAnIntegerGrid(
                    f"its zero points are fractions (one is {value:.6g}), while integer grids store whole zero "
                    f"points from 0 to {layout.max_code}; quantize it with symmetric=True"
                )
            zero = zero.to(torch.uint8)
        return IntegerGrid(layout.bits, layout.group_size, codes, stored["weight_scale"], zero)

    def from_integer_grid(self, layout: StorageLayout, grid: IntegerGrid) -> dict[str, torch.Tensor]:
        _whole_groups(layout)
        length = grid.group_size or layout.in_features
        expected = (layout.bits, layout.group_length, not self.has_zero(layout))
        if (grid.bits, length, grid.symmetric) != expected:
            raise NotAnIntegerGrid(
                f"a {grid.bits}-bit grid in groups of {length} (symmetric={grid.symmetric}) does not fit a layout of "
                f"{layout.bits} bits in groups of {layout.group_length} (symmetric={not self.has_zero(layout)})"
            )
        if tuple(grid.codes.shape) != (layout.out_features, layout.in_features):
            raise NotAnIntegerGrid(
                f"codes of shape {tuple(grid.codes.shape)} for a layout of {layout.out_features} "
                f"x {layout.in_features} weights"
            )
        if not torch.equal(grid.scale.to(layout.scale_dtype).to(grid.scale.dtype), grid.scale):
            raise NotAnIntegerGrid(f"{grid.scale.dtype} scales do not fit the layout's {layout.scale_dtype} scales")
        codes = grouping.group(grid.codes, layout.group_size)
        zero = None if grid.zero is None else grid.zero.float()
        return self.store(layout, codes, GroupParams(scale=grid.scale.float(), zero=zero))


def _whole_groups(layout: StorageLayout) -> None:
    if layout.in_features % layout.group_length:
        raise NotAnIntegerGrid(
            f"its {layout.in_features} input features do not split into groups of {layout.group_length} (quantlab "
            f"pads the last group, which integer-grid formats do not store)"
        )


AFFINE = register_codec(AffineCodec())
