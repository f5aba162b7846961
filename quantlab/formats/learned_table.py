"""The `lut` codec: a non-uniform grid learned per layer, `2**bits` levels times a scale per group.

Each layer keeps one sorted table of `2**bits` levels (16 at 4 bits, 8 at 3 bits) in [-1, 1], its
two ends pinned at -1 and 1, and each group of `group_size` weights one scale (its range, shrunk
by the solver's clipping search); a weight decodes as `table[q] * scale`, as NF4's and IQ4_NL's do
with their fixed tables. The table is what the layer's weights want instead of a fixed one: any4
(Elhoushi et al., arXiv 2507.04610) learns such tables per row; here one per layer, so the
native kernels read it as they read NF4's (one 16-float table per weight).

The interior levels are fitted by weighted k-means (Lloyd's iterations) on the weights divided by
their group's scale, each weight counted by its squared scale times its input channel's `E[x^2]`
(uniform without calibration data): that is the layer's output error, up to the cross terms GPTQ
then handles. Table and scales are fitted in turn (`ROUNDS` times). The table is stored as
float16 (`weight_table`), and codes are chosen against the stored numbers.

The table costs `16 * 2**bits` bits per layer: 0.0012 bits per weight on a 576 x 192 layer at 3 bits.
No GGUF type holds a learned table, and the codes are not an integer grid (compressed-tensors).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch

from quantlab.formats import fast_path, grouping, packing
from quantlab.formats.codec import Codec, GroupParams, TensorSpec, register_codec

if TYPE_CHECKING:
    from quantlab.formats.layout import StorageLayout

BITS = (2, 3, 4)
ITERATIONS = 25  # Lloyd iterations per fit of the table
ROUNDS = 3  # table, then scales, then the table again ...
CLIP_RATIOS = tuple(round(1.0 - 0.05 * step, 2) for step in range(11))  # a group's range shrunk to 100 % .. 50 %
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TABLE_DTYPE = torch.float16


@functools.cache
def start_table(bits: int) -> tuple[float, ...]:
    """The table before fitting: quantiles of a normal distribution, rescaled to [-1, 1] (NF-like)."""
    count = 1 << bits
    normal = torch.distributions.Normal(0.0, 1.0)
    inner = normal.icdf(torch.linspace(0.5 / count, 1 - 0.5 / count, count, dtype=torch.float64))
    return _stored_table(inner / inner.abs().max())


def fit_table(
    grouped: torch.Tensor, scale: torch.Tensor, importance: torch.Tensor, table: tuple[float, ...]
) -> tuple[float, ...]:
    """The interior levels that minimise the weighted squared error of `grouped` `[out, groups, length]`
    on grids `scale` `[out, groups]`, from `table` (Lloyd's iterations; the ends stay at -1 and 1).

    `importance` `[1, groups, length]` weights each input position (0 on padding)."""
    divisor = torch.where(scale == 0, torch.inf, scale).unsqueeze(-1)
    values = (grouped / divisor).clamp(-1, 1).reshape(-1).double()
    weights = (scale.unsqueeze(-1).square() * importance).expand_as(grouped).reshape(-1).double()
    levels = torch.tensor(table, dtype=torch.float64)
    for _ in range(ITERATIONS):
        cells = torch.bucketize(values, (levels[:-1] + levels[1:]) / 2)
        mass = torch.bincount(cells, weights, minlength=len(levels))
        moment = torch.bincount(cells, weights * values, minlength=len(levels))
        moved = torch.where(mass > 0, moment / mass.clamp(min=1e-300), levels)
        moved[0], moved[-1] = -1.0, 1.0
        moved = moved.sort().values
        if torch.equal(moved, levels):
            break
        levels = moved
    return _stored_table(levels)


def _stored_table(levels: torch.Tensor) -> tuple[float, ...]:
    """Sorted levels as stored (float16), as a tuple of float32 values."""
    rounded = levels.to(TABLE_DTYPE).float().sort().values
    return tuple(rounded.tolist())


@functools.lru_cache(maxsize=64)
def _tables(table: tuple[float, ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    levels = torch.tensor(table, dtype=torch.float32, device=device)
    return levels, (levels[:-1] + levels[1:]) / 2


@dataclasses.dataclass(frozen=True)
class LearnedTableOptions:
    """`table`: the layer's learned levels, sorted, as stored (None: not fitted yet)."""

    table: tuple[float, ...] | None = None


class LearnedTableCodec(Codec):
    """Codes packed `bits` to the byte, a scale per group and one float16 table per layer."""

    name = "lut"
    native_kind = 4  # QL_LUT: the table path of the kernels, with the layer's own table
    onnx_lowering = "level-table"
    native_table_argument = True
    options_type = LearnedTableOptions

    def validate(self, layout: StorageLayout) -> None:
        if layout.bits not in BITS:
            raise ValueError(f"the lut codec stores {BITS[0]}-{BITS[-1]}-bit codes, got bits={layout.bits}")
        if layout.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"the lut codec stores float scales, got scale_dtype={layout.scale_dtype}")
        table = layout.options.table
        if table is not None and (
            len(table) != 1 << layout.bits or list(table) != sorted(table) or table[0] != -1.0 or table[-1] != 1.0
        ):
            raise ValueError(f"a lut table holds {1 << layout.bits} sorted levels from -1 to 1, got {table}")

    def tensors(self, layout: StorageLayout) -> dict[str, TensorSpec]:
        out, groups = layout.out_features, layout.groups
        return {
            "weight": TensorSpec((out, groups, packing.packed_size(layout.group_length, layout.bits)), torch.uint8),
            "weight_scale": TensorSpec((out, groups), layout.scale_dtype),
            "weight_table": TensorSpec((1 << layout.bits,), TABLE_DTYPE),
        }

    def native_arguments(self, layout: StorageLayout) -> tuple[str | None, ...]:
        return ("weight_scale", "weight_table")  # the table in the zero points' place (`native_table_argument`)

    # -- the table ------------------------------------------------------------------------------

    def prepare(
        self, layout: StorageLayout, weight: torch.Tensor, channel_weights: torch.Tensor | None = None
    ) -> StorageLayout:
        """Table and range scales fitted in turn (`ROUNDS`), from the normal-quantile table."""
        grouped = grouping.group(weight.detach().float(), layout.group_size)
        importance = grouping.position_weights(layout.in_features, layout.group_size, channel_weights)
        fitted = _with_table(layout, start_table(layout.bits))
        for _ in range(ROUNDS):
            scale = search_scales(self, fitted, grouped, importance).scale
            fitted = _with_table(fitted, fit_table(grouped, scale, importance, fitted.options.table))
        return fitted

    def bind(self, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> StorageLayout:
        return _with_table(layout, tuple(stored["weight_table"].detach().float().cpu().tolist()))

    def learned_table(self, layout: StorageLayout) -> tuple[float, ...] | None:
        return layout.options.table

    def with_table(self, layout: StorageLayout, levels: torch.Tensor) -> StorageLayout:
        """The table `levels` (ends at -1 and 1) rounded as stored."""
        return _with_table(layout, _stored_table(levels.detach().double().cpu()))

    def levels(self, layout: StorageLayout, device: torch.device | str = "cpu") -> torch.Tensor:
        """The layer's table (the normal-quantile start before `prepare` or `bind`)."""
        return _tables(layout.options.table or start_table(layout.bits), str(device))[0]

    # -- round to nearest -----------------------------------------------------------------------

    def quantize(self, layout: StorageLayout, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The table fitted to this weight alone, then per group the scale of least squared error
        (`search_scales`) and the nearest levels on it."""
        layout = layout.prepare(weight) if layout.options.table is None else layout
        grouped = grouping.group(weight.float(), layout.group_size)
        params = search_scales(self, layout, grouped, torch.ones(1, layout.groups, layout.group_length))
        return self.store(layout, self.encode_grouped(layout, grouped, params), params)

    # -- the grid -------------------------------------------------------------------------------

    def fit(
        self, layout: StorageLayout, grouped: torch.Tensor, clip: torch.Tensor | float = 1.0, signed: bool = False
    ) -> GroupParams:
        """The group's largest magnitude (times `clip`) on the table's ends, -1 and 1."""
        return self.grid(layout, grouping.clipped_absmax(grouped, clip))

    def grid(self, layout: StorageLayout, scale: torch.Tensor, zero: torch.Tensor | None = None) -> GroupParams:
        """Scales as stored. A scale of 0 stays 0: the group decodes to zeros."""
        return GroupParams(scale=scale.to(layout.scale_dtype).float())

    def encode(
        self, layout: StorageLayout, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> torch.Tensor:
        scale = scale.float()
        divisor = torch.where(scale == 0, torch.inf, scale)  # scale 0: every weight on the level nearest 0
        midpoints = _tables(layout.options.table or start_table(layout.bits), str(values.device))[1]
        return fast_path.bucketize((values.float() / divisor).contiguous(), midpoints).to(torch.uint8)

    def decode(
        self, layout: StorageLayout, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> torch.Tensor:
        return torch.take(self.levels(layout, codes.device), codes.long()) * scale.float()

    # -- stored tensors -------------------------------------------------------------------------

    def store(self, layout: StorageLayout, codes: torch.Tensor, params: GroupParams) -> dict[str, torch.Tensor]:
        if layout.options.table is None:
            raise ValueError("a lut layout stores its fitted table: fit it first (StorageLayout.prepare)")
        return {
            "weight": fast_path.pack(codes.to(torch.uint8), layout.bits),
            "weight_scale": params.scale.to(layout.scale_dtype),
            "weight_table": torch.tensor(layout.options.table, dtype=TABLE_DTYPE),
        }

    def load(self, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> tuple[torch.Tensor, GroupParams]:
        return self.codes(layout, stored["weight"]), self.params(layout, stored)

    def codes(self, layout: StorageLayout, weight: torch.Tensor) -> torch.Tensor:
        return packing.unpack(weight, layout.bits, layout.group_length)

    def params(self, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> GroupParams:
        return GroupParams(scale=stored["weight_scale"].float())

    def label(self, layout: StorageLayout) -> str:
        return f"lut{layout.bits}"


def _with_table(layout: StorageLayout, table: tuple[float, ...]) -> StorageLayout:
    """`layout` with the level table `table` (the layout itself when it has that table already)."""
    if layout.options.table == table:
        return layout
    return dataclasses.replace(layout, options=dataclasses.replace(layout.options, table=table))


def search_scales(codec: Codec, layout: StorageLayout, grouped: torch.Tensor, importance: torch.Tensor) -> GroupParams:
    """Per group, the scale of least weighted squared error among the range shrunk by `CLIP_RATIOS`,
    then one least-squares refit to the chosen codes where it lowers the error."""
    best, best_error = None, None
    for ratio in CLIP_RATIOS:
        best, best_error = _better(
            codec, layout, grouped, importance, codec.fit(layout, grouped, ratio), best, best_error
        )
    level = codec.levels(layout, grouped.device)[codec.encode_grouped(layout, grouped, best).long()]
    weights = importance.expand_as(grouped)
    refit = (weights * level * grouped).sum(-1) / (weights * level.square()).sum(-1).clamp(min=1e-30)
    refit = torch.where(refit > 0, refit, best.scale)
    return _better(codec, layout, grouped, importance, codec.grid(layout, refit), best, best_error)[0]


def _better(
    codec: Codec,
    layout: StorageLayout,
    grouped: torch.Tensor,
    importance: torch.Tensor,
    candidate: GroupParams,
    best: GroupParams | None,
    best_error: torch.Tensor | None,
) -> tuple[GroupParams, torch.Tensor]:
    """The candidate's scale where it lowers a group's weighted error (the earlier one wins ties)."""
    values = codec.decode(layout, codec.encode_grouped(layout, grouped, candidate), candidate.scale.unsqueeze(-1), None)
    error = ((grouped - values).square() * importance).sum(dim=-1)
    if best is None:
        return candidate, error
    better = error < best_error
    return GroupParams(scale=torch.where(better, candidate.scale, best.scale)), torch.where(better, error, best_error)


LUT = register_codec(LearnedTableCodec())
