"""A quantized Linear layer whose codes are frozen and whose grids (scales, zero points, level tables) train.

EfficientQAT's end-to-end phase (E2E-QP, Chen et al. 2024, arXiv 2407.11062) trains only the
quantization parameters of a quantized model: each group's scale (and zero point, where the format
stores one) while the codes stay as a solver chose them. The weight of a group is
`(level[q] - zero) * scale`, linear in both, so the gradients are exact, with no straight-through
estimate but for the rounding of the learned numbers to what is stored (float16 scales, NF4's
double-quantized absmax):

    d loss / d scale_g = sum_{j in g} G_ij (level[q_ij] - zero_g),   d loss / d zero_g = -scale_g sum_{j in g} G_ij

with `G = dy^T x` the weight's gradient. A layer with a level table of its own (`lut`) trains its
interior levels too (its ends, -1 and 1, are what the scales are measured against), and the codes
keep indexing the same level:

    d loss / d level_k = sum_{ij : q_ij = k} G_ij scale_g(ij)

The levels stay sorted and within the ends (`project`), and compute as rounded to their stored precision.

What makes it cheap is what is kept: the codes (one byte a weight) and a few numbers a group. The
float weight is decoded for the product and dropped, decoded again in the backward pass, and `G`
lives only while one layer's gradient is reduced to its groups: nothing a weight wide is saved
between the passes, so a model's training memory is its codes, its float rest and its activations,
not five floats a weight as when the weights themselves train (`quantlab.nn.fake_quant`).
"""

import torch
from torch import nn
from torch.nn import functional as F

from quantlab.formats import grouping
from quantlab.formats.layout import GroupParams, StorageLayout
from quantlab.nn.rotation import rotate
from quantlab.utils.scratch import scratch

SCALE_RANGE = (0.5, 1.5)  # a group's scale stays within these multiples of its starting scale


class TrainedGrid(nn.Module):
    """The frozen codes of one layer and its trainable grids, starting from its stored tensors."""

    def __init__(
        self, layout: StorageLayout, codes: torch.Tensor, params: GroupParams, learn_zero: bool = True
    ) -> None:
        super().__init__()
        self.layout = layout
        self.start = params  # the grids as stored: the first forward pass computes the checkpoint's weight
        self.register_buffer("codes", codes.to(torch.uint8), persistent=False)
        self.register_buffer("start_scale", params.scale.clone(), persistent=False)
        self.scale_ratio = nn.Parameter(torch.ones_like(params.scale))
        self.zero = None if params.zero is None else nn.Parameter(params.zero.clone(), requires_grad=learn_zero)
        # a learned table's interior levels (its ends fixed: the scales are measured against them)
        table = layout.learned_table
        self.table = None if table is None else nn.Parameter(torch.tensor(table[1:-1]))
        self._integer_levels = self._decodes_as_integers()  # level[q] = q: one subtraction, in place

    @classmethod
    def from_stored(cls, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> "TrainedGrid":
        """From a layer's stored tensors (`QuantizedLinear.stored_tensors()`)."""
        layout = layout.bind(stored)
        codes, params = layout.load(stored)
        params.stored = {name: tensor for name, tensor in stored.items() if name != "weight"}
        return cls(layout, codes, params)

    def current_layout(self) -> StorageLayout:
        """The layout with the table as it would be stored now (the layout itself when no table trains)."""
        if self.table is None:
            return self.layout
        table = self.layout.learned_table
        ends = torch.tensor(table[:: len(table) - 1])
        return self.layout.with_table(torch.cat([ends[:1], self.table.detach().cpu(), ends[1:]]))

    def grid(self) -> GroupParams:
        """The grids as they would be stored now (the solver's own while nothing has moved)."""
        if self._at_start():
            return self.start
        zero = None if self.zero is None else self.zero.detach()
        return self.layout.grid(self.start_scale * self.scale_ratio.detach(), zero)

    def learned(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale and zero point `[out, groups]`: the values stored, with the gradients of the learned numbers."""
        stored = self.grid()
        scale = self.start_scale * self.scale_ratio
        scale = scale + (stored.scale - scale).detach()
        if self.zero is None or not self.zero.requires_grad:
            return scale, stored.zero
        return scale, self.zero + (stored.zero - self.zero).detach()

    def levels_minus_zero(self, zero: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """`level[q] - zero` `[out, groups, length]`: the weight at scale 1, and its gradient per unit of scale
        (into `out` when given)."""
        if out is not None and self._integer_levels:  # (the check at construction decodes without `out`)
            return torch.sub(self.codes, self.layout.constant_zero if zero is None else zero.unsqueeze(-1), out=out)
        ones = torch.ones((*self.codes.shape[:2], 1), dtype=torch.float32, device=self.codes.device)
        unit = self.current_layout().decode(self.codes, ones, None if zero is None else zero.unsqueeze(-1))
        return unit if out is None else out.copy_(unit)

    def weight(self) -> torch.Tensor:
        """The float `[out, in]` weight the grids decode to now (no gradient)."""
        with torch.no_grad():
            params = self.grid()
            unit = self.levels_minus_zero(params.zero)
            return grouping.ungroup(unit * params.scale.unsqueeze(-1), self.layout.in_features)

    def stored(self) -> dict[str, torch.Tensor]:
        """The layer's tensors, as `QuantizedLinear.load_stored` takes them: the same codes, the trained grids."""
        return self.current_layout().store(self.codes, self.grid())

    @torch.no_grad()
    def project(self) -> None:
        """Keep the scales within `SCALE_RANGE` of their start and a table's levels sorted between its ends
        (after each optimizer step)."""
        self.scale_ratio.clamp_(*SCALE_RANGE)
        if self.table is not None:
            low, high = self.layout.learned_table[0], self.layout.learned_table[-1]
            self.table.copy_(torch.cummax(self.table.clamp(low, high), dim=0).values)

    def _decodes_as_integers(self) -> bool:
        """Whether the codec's decoding is `q - zero` at scale 1 (integer levels), checked on this layer's codes."""
        if self.layout.levels() is not None:
            return False
        zero = self.start.zero
        decoded = self.levels_minus_zero(zero)  # the codec's own decoding at scale 1
        direct = self.codes.float() - (self.layout.constant_zero if zero is None else zero.unsqueeze(-1))
        return torch.equal(decoded, direct)

    def _at_start(self) -> bool:
        if not torch.all(self.scale_ratio == 1):
            return False
        if self.table is not None and self.current_layout().learned_table != self.layout.learned_table:
            return False
        return self.zero is None or torch.equal(self.zero, self.start.zero)


class GridTrainedLinear(nn.Module):
    """A Linear layer computing with a `TrainedGrid`'s weight; its bias stays fixed, as a quantized layer's does."""

    def __init__(self, grid: TrainedGrid, bias: torch.Tensor | None, input_rotation: int = 0) -> None:
        super().__init__()
        self.weight_quantizer = grid
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.input_rotation = input_rotation  # the quantized layer's (`quantlab.nn.rotation`); 0: none

    @property
    def in_features(self) -> int:
        return self.weight_quantizer.layout.in_features

    @property
    def out_features(self) -> int:
        return self.weight_quantizer.layout.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.weight_quantizer
        if self.input_rotation:
            x = rotate(x, self.input_rotation)
        if not torch.is_grad_enabled():
            return F.linear(x, grid.weight().to(x.dtype), self.bias)
        scale, zero = grid.learned()
        trained_zero = zero if zero is not None and zero.requires_grad else None
        fixed_zero = None if trained_zero is not None else zero
        return _GridLinear.apply(x, scale, trained_zero, grid.table, grid, fixed_zero, self.bias)


class _GridLinear(torch.autograd.Function):
    """`x W^T + b` with `W` decoded from frozen codes and trainable grids, nothing weight-sized saved.

    The decoded weight and the weight's gradient live in scratch buffers (`quantlab.utils.scratch`)
    reused by every layer, and the backward pass works in place on them."""

    @staticmethod
    def forward(ctx, x, scale, trained_zero, table, grid, fixed_zero, bias):
        zero = trained_zero if trained_zero is not None else fixed_zero
        shape = grid.codes.shape
        weight = grid.levels_minus_zero(zero, out=scratch("grid.weight", shape)).mul_(scale.unsqueeze(-1))
        ctx.save_for_backward(x, scale, zero)
        ctx.grid, ctx.trains_zero = grid, trained_zero is not None
        return F.linear(x, grouping.ungroup(weight, grid.layout.in_features).to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, scale, zero = ctx.saved_tensors
        grid = ctx.grid
        shape, in_features = grid.codes.shape, grid.layout.in_features
        unit = grid.levels_minus_zero(zero, out=scratch("grid.unit", shape))
        rows = grad_output.reshape(-1, grad_output.shape[-1]).float()
        inputs = x.reshape(-1, x.shape[-1]).float()
        grouped = scratch("grid.gradient", shape)
        if shape[1] * shape[2] == in_features:
            torch.mm(rows.t(), inputs, out=grouped.view(shape[0], in_features))
        else:  # a padded last group: no gradient on the padding
            grouped.zero_()
            grouped.view(shape[0], -1)[:, :in_features] = rows.t() @ inputs
        grad_zero = -(grouped.sum(-1) * scale) if ctx.trains_zero else None
        grad_table = None
        if ctx.needs_input_grad[3]:  # input 3, a trained table: G scale summed by code, in the free buffer
            scaled = torch.mul(grouped, scale.unsqueeze(-1), out=scratch("grid.weight", shape))
            levels = torch.bincount(grid.codes.reshape(-1), scaled.view(-1), minlength=grid.table.numel() + 2)
            grad_table = levels[1:-1].to(grid.table.dtype)
        grad_scale = grouped.mul_(unit).sum(-1)
        grad_x = None
        if ctx.needs_input_grad[0]:
            weight = grouping.ungroup(unit.mul_(scale.unsqueeze(-1)), in_features)
            grad_x = (grad_output @ weight.to(grad_output.dtype)).to(x.dtype)
        return grad_x, grad_scale, grad_zero, grad_table, None, None, None
