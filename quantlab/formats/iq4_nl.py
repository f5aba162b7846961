"""The `iq4_nl` codec: llama.cpp's IQ4_NL, a fixed non-uniform table of 16 levels times a float16 scale.

Each group of `group_size` weights (32 in a GGUF IQ4_NL block) stores 4-bit indices into
`KVALUES` and one float16 `d`; a weight decodes as `d * KVALUES[q]` (ggml-common.h,
`kvalues_iq4nl`). The table is denser near zero than a uniform grid, like NF4's, but it is
the one every llama.cpp build decodes, so a layer of this codec exports to GGUF as IQ4_NL
blocks exactly: same indices, same `d`, same float32 products.

The table is not symmetric (-127 against 113), so a negative `d` mirrors it: a group's
largest-magnitude weight can reach -127 whichever its sign (`signed_grids`). Codes are the
nearest level of `w / d` with `d` already rounded to float16, so they are chosen against the
number that is stored (llama.cpp's quantizer picks its codes against the float `d` and rounds
`d` afterwards). Round to nearest (`quantize`) tries a few scales per group in both
orientations, as llama.cpp's `quantize_row_iq4_nl_impl` does, then refits `d` to the chosen
codes by least squares, and keeps the candidate with the least squared error; the calibrated
solvers start from `fit` and search the grid themselves.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from quantlab.formats import fast_path, grouping, packing
from quantlab.formats.codec import (
    Codec,
    GGUFBlocks,
    GroupParams,
    TensorSpec,
    float16_exact,
    per_block,
    register_codec,
)

if TYPE_CHECKING:
    from quantlab.formats.layout import StorageLayout

KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
BITS = 4
LOWEST, HIGHEST = KVALUES[0], KVALUES[-1]
# Round to nearest: each group's range times these ratios, in both orientations (llama.cpp tries
# its extreme on levels -120 to -134 of the table, ratios 0.95 to 1.06), then least-squares refits.
SEARCH_RATIOS = tuple(round(0.80 + 0.02 * step, 2) for step in range(16))
REFITS = 2


def levels(device: torch.device | str = "cpu") -> torch.Tensor:
    """The table as float32 (a cached tensor per device: read it, do not modify it)."""
    return _tables(str(device))[0]


def midpoints(device: torch.device | str = "cpu") -> torch.Tensor:
    """Boundaries between neighbouring levels: a value's nearest level is its bucket (ties go down)."""
    return _tables(str(device))[1]


@functools.cache
def _tables(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.tensor(KVALUES, dtype=torch.float32, device=device)
    return table, (table[:-1] + table[1:]) / 2


class IQ4NLCodec(Codec):
    """Indices packed two to the byte and one float16 scale per group."""

    name = "iq4_nl"
    native_kind = 3  # QL_IQ4_NL: the table path of the kernels, with this table
    onnx_lowering = "level-table"

    def validate(self, layout: StorageLayout) -> None:
        if layout.bits != BITS:
            raise ValueError(f"the iq4_nl codec stores 4-bit codes, got bits={layout.bits}")
        if layout.scale_dtype != torch.float16:
            raise ValueError(
                f"the iq4_nl codec stores float16 scales (IQ4_NL's d), got scale_dtype={layout.scale_dtype}"
            )

    def tensors(self, layout: StorageLayout) -> dict[str, TensorSpec]:
        out, groups = layout.out_features, layout.groups
        return {
            "weight": TensorSpec((out, groups, packing.packed_size(layout.group_length, BITS)), torch.uint8),
            "weight_scale": TensorSpec((out, groups), torch.float16),
        }

    def native_arguments(self, layout: StorageLayout) -> tuple[str | None, ...]:
        return ("weight_scale",)

    def native_tables(self) -> dict[str, tuple[float, ...]]:
        return {"levels": tuple(float(value) for value in KVALUES)}

    # -- round to nearest -----------------------------------------------------------------------

    def quantize(self, layout: StorageLayout, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per group, the float16 `d` (and its nearest codes) with the least squared error among
        `SEARCH_RATIOS` of the range in both orientations, then `REFITS` least-squares refits."""
        grouped = grouping.group(weight.float(), layout.group_size)
        params = search_scales(self, layout, grouped)
        return self.store(layout, self.encode_grouped(layout, grouped, params), params)

    # -- the grid -------------------------------------------------------------------------------

    def levels(self, layout: StorageLayout, device: torch.device | str = "cpu") -> torch.Tensor:
        return levels(device)

    def signed_grids(self, layout: StorageLayout) -> bool:
        return True

    def fit(
        self, layout: StorageLayout, grouped: torch.Tensor, clip: torch.Tensor | float = 1.0, signed: bool = False
    ) -> GroupParams:
        """`d > 0` covering both ends of the group (its minimum on -127, or its maximum on 113); with
        `signed`, the largest-magnitude weight on -127 through a `d` of its opposite sign."""
        clip = torch.as_tensor(clip, dtype=torch.float32, device=grouped.device)
        both_ends, extreme_lowest = range_scales(grouped)
        return self.grid(layout, (extreme_lowest if signed else both_ends) * clip)

    def grid(self, layout: StorageLayout, scale: torch.Tensor, zero: torch.Tensor | None = None) -> GroupParams:
        """`d` as stored (float16). A `d` of 0 stays 0: the group decodes to zeros (no level is 0)."""
        return GroupParams(scale=scale.to(torch.float16).float())

    def encode(
        self, layout: StorageLayout, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> torch.Tensor:
        scale = scale.float()
        divisor = torch.where(scale == 0, torch.inf, scale)  # d = 0: every weight on the level nearest 0
        return fast_path.bucketize((values.float() / divisor).contiguous(), midpoints(values.device)).to(torch.uint8)

    def decode(
        self, layout: StorageLayout, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> torch.Tensor:
        return torch.take(levels(codes.device), codes.long()) * scale.float()

    # -- stored tensors -------------------------------------------------------------------------

    def store(self, layout: StorageLayout, codes: torch.Tensor, params: GroupParams) -> dict[str, torch.Tensor]:
        return {"weight": fast_path.pack(codes.to(torch.uint8), BITS), "weight_scale": params.scale.to(torch.float16)}

    def codes(self, layout: StorageLayout, weight: torch.Tensor) -> torch.Tensor:
        return packing.unpack(weight, BITS, layout.group_length)

    def params(self, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> GroupParams:
        return GroupParams(scale=stored["weight_scale"].float())

    # -- GGUF -------------------------------------------------------------------------------------

    def gguf_type(self, layout: StorageLayout) -> str | None:
        """IQ4_NL blocks hold the same indices and the same float16 `d`."""
        return "IQ4_NL"

    def gguf_blocks(self, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> GGUFBlocks:
        codes, params = self.load(layout, stored)
        scale = float16_exact(per_block(params.scale, layout), "a scale")
        return GGUFBlocks("IQ4_NL", grouping.ungroup(codes, layout.in_features), scale)


def range_scales(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float scales `[out, groups]` of `fit` at clip 1: (covering both ends with `d > 0`, the extreme on -127)."""
    grouped = grouped.float()
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    extreme = grouped.gather(-1, grouped.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    return torch.maximum(low / LOWEST, high / HIGHEST), extreme / LOWEST


def search_scales(codec: Codec, layout: StorageLayout, grouped: torch.Tensor) -> GroupParams:
    """Each group's float16 `d` with the least squared error over the candidates (see `quantize`)."""
    best, best_error = None, None
    for base in range_scales(grouped):
        for ratio in SEARCH_RATIOS:
            candidate = codec.grid(layout, base * torch.tensor(ratio))  # as `fit(grouped, ratio, signed)`
            best, best_error = _better(codec, layout, grouped, candidate, best, best_error)
    for _ in range(REFITS):
        candidate = codec.grid(layout, _least_squares_scale(codec, layout, grouped, best))
        best, best_error = _better(codec, layout, grouped, candidate, best, best_error)
    return best


def _error(codec: Codec, layout: StorageLayout, grouped: torch.Tensor, params: GroupParams) -> torch.Tensor:
    scale = params.scale.unsqueeze(-1)
    codes = codec.encode(layout, grouped, scale, None)
    return (grouped - codec.decode(layout, codes, scale, None)).square().sum(dim=-1)


def _better(
    codec: Codec,
    layout: StorageLayout,
    grouped: torch.Tensor,
    candidate: GroupParams,
    best: GroupParams | None,
    best_error: torch.Tensor | None,
) -> tuple[GroupParams, torch.Tensor]:
    """The candidate's grids where they lower a group's error (the first candidate wins ties)."""
    error = _error(codec, layout, grouped, candidate)
    if best is None:
        return candidate, error
    better = error < best_error
    return GroupParams(scale=torch.where(better, candidate.scale, best.scale)), torch.where(better, error, best_error)


def _least_squares_scale(
    codec: Codec, layout: StorageLayout, grouped: torch.Tensor, params: GroupParams
) -> torch.Tensor:
    """The float `d` minimising the squared error for the codes chosen on `params`: sum(l x) / sum(l^2)."""
    codes = codec.encode(layout, grouped, params.scale.unsqueeze(-1), None)
    level = levels(grouped.device)[codes.long()]
    return (level * grouped).sum(dim=-1) / level.square().sum(dim=-1)  # levels are never 0: sum(l^2) > 0


IQ4_NL = register_codec(IQ4NLCodec())
