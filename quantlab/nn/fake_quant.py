"""A weight held on a storage layout's grid whose rounding, scales and zero points can be trained.

The forward pass computes the weight the layout would store, with the codec's own `encode` and
`decode` on grids rounded as stored (`StorageLayout.grid`: scale dtype, NF4's double quantization),
so it equals `layout.dequantize(layout.store(*quantizer.solution()))` bit for bit. Gradients pass
straight through the rounding as in LSQ (Esser et al. 2019, arXiv 1902.08153): in the code domain
`t = w / scale + zero`, `d out / d w = 1` where `t` lies inside the grid's range and 0 where it is
clipped, and the scale receives `level - t` (the rounding error, and the clipping error of clipped
weights), so learning the scale is learning the clipping (OmniQuant's learnable weight clipping).

What is trained (all optional but the offsets):
- `offset`: a rounding offset per weight in grid steps (AutoRound's `v`; a step is one code on integer
  grids, the mean distance between levels on level tables such as NF4's), bounded by `max_offset`;
  unbounded it is a weight delta trained through the quantizer (EfficientQAT's Block-AP);
- `scale_ratio`: each group's scale as a multiple of its starting scale, kept in `SCALE_RANGE`;
- `zero`: each group's zero point, where the codec stores one.

The starting point is any solver's codes and grids, reproduced exactly by the first forward pass: a
weight the solver rounded to nearest keeps its float value as its latent value (AutoRound's start:
a weight near a rounding boundary flips with a small offset), a weight whose code the solver moved
(GPTQ's error feedback) starts at its code's level, half a step from either boundary, so the first
steps of training do not undo the solver's corrections.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from quantlab.formats import grouping
from quantlab.formats.layout import GroupParams, StorageLayout
from quantlab.nn.rotation import rotate

SCALE_RANGE = (0.5, 1.5)  # a group's scale stays within these multiples of its starting scale
_CELL_MARGIN = 0.02  # a float weight this close to its cell's boundary (fraction of the way) starts at the level


class FakeQuantizedWeight(nn.Module):
    """A `[out, in]` weight on `layout`'s grid, starting from `codes` and `params` (a solver's solution)."""

    def __init__(
        self,
        layout: StorageLayout,
        weight: torch.Tensor,
        codes: torch.Tensor,
        params: GroupParams,
        max_offset: float | None = 0.5,
        learn_scales: bool = True,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.max_offset = max_offset
        self.start = params  # the grids as the solver stored them (NF4 keeps its double-quantized absmax)
        levels = layout.levels()
        self.register_buffer("levels", torch.arange(layout.max_code + 1.0) if levels is None else levels.float())
        # An offset of 1 is one (mean) grid step at the starting scale: one code on integer grids.
        step = float(self.levels[-1] - self.levels[0]) / (len(self.levels) - 1)
        self.register_buffer("unit", params.scale * step)
        zero = self._zero_or_constant(params.zero)
        grouped = grouping.group(weight.detach().float(), layout.group_size)
        self.register_buffer("start_scale", params.scale.clone())
        self.register_buffer("base", self._pulled_into_cells(grouped, codes, params.scale, zero))
        self.offset = nn.Parameter(torch.zeros_like(self.base))
        self.scale_ratio = nn.Parameter(torch.ones_like(self.start_scale), requires_grad=learn_scales)
        self.zero = None if params.zero is None else nn.Parameter(params.zero.clone(), requires_grad=learn_scales)

    @classmethod
    def from_solution(
        cls,
        layout: StorageLayout,
        weight: torch.Tensor,
        stored: dict[str, torch.Tensor],
        max_offset: float | None = 0.5,
        learn_scales: bool = True,
    ) -> "FakeQuantizedWeight":
        """Start from a layer's stored tensors (`QuantizedLinear.stored_tensors()`) and its float weight."""
        layout = layout.bind(stored)  # a learned level table is the layer's own
        codes, params = layout.load(stored)
        # What the codec derived from the grids when it stored them (NF4's 8-bit absmax) is kept as stored.
        params.stored = {name: tensor for name, tensor in stored.items() if name != "weight"}
        return cls(layout, weight, codes, params, max_offset, learn_scales)

    # -- the grid and the codes -------------------------------------------------------------

    def grid(self) -> GroupParams:
        """The grids as stored: the solver's own while the learnable ones are at their start."""
        if self._at_start():
            return self.start
        zero = None if self.zero is None else self.zero.detach()
        return self.layout.grid(self.start_scale * self.scale_ratio.detach(), zero)

    def latent(self) -> torch.Tensor:
        """The grouped weight `[out, groups, length]` that is rounded."""
        return torch.addcmul(self.base, self.offset, self.unit.unsqueeze(-1))

    def solution(self) -> tuple[torch.Tensor, GroupParams]:
        """Codes `[out, groups, length]` and grids: `layout.store(*solution())` is what `forward` computes."""
        with torch.no_grad():
            params = self.grid()
            codes = self.layout.quantize_grouped(self.latent(), params)
        return codes, params

    def stored(self) -> dict[str, torch.Tensor]:
        """The layer's tensors, as `QuantizedLinear.load_stored` takes them."""
        return self.layout.store(*self.solution())

    # -- training ---------------------------------------------------------------------------

    def forward(self) -> torch.Tensor:
        """The dequantized `[out, in]` weight, with straight-through gradients to what is trained."""
        params = self.grid()
        scale = _unsqueezed(params.scale)
        stored_zero = None if params.zero is None else _unsqueezed(params.zero)
        latent = self.latent()
        with torch.no_grad():
            hard, level = self.layout.round_trip(latent, scale, stored_zero)
        if not torch.is_grad_enabled():
            return grouping.ungroup(hard, self.layout.in_features)
        learned_scale = self.start_scale.unsqueeze(-1) * self.scale_ratio.unsqueeze(-1)
        learned_zero = None if self.zero is None else self.zero.unsqueeze(-1)
        zero = self.layout.constant_zero if stored_zero is None else stored_zero
        weight = _StraightThrough.apply(
            latent, learned_scale, learned_zero, hard, scale, zero, level, self.levels[0], self.levels[-1]
        )
        return grouping.ungroup(weight, self.layout.in_features)

    @torch.no_grad()
    def project(self) -> None:
        """Keep the trained numbers in their ranges (after each optimizer step)."""
        if self.max_offset is not None:
            self.offset.clamp_(-self.max_offset, self.max_offset)
        self.scale_ratio.clamp_(*SCALE_RANGE)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the trained numbers (`restore` puts them back)."""
        return {name: value.detach().clone() for name, value in self.named_parameters()}

    @torch.no_grad()
    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        for name, value in self.named_parameters():
            value.copy_(snapshot[name])

    # -- helpers ----------------------------------------------------------------------------

    def _at_start(self) -> bool:
        if not torch.all(self.scale_ratio == 1):
            return False
        return self.zero is None or torch.equal(self.zero, self.start.zero)

    def _zero_or_constant(self, zero: torch.Tensor | None) -> torch.Tensor | float:
        return self.layout.constant_zero if zero is None else zero.unsqueeze(-1)

    def _pulled_into_cells(
        self, grouped: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | float
    ) -> torch.Tensor:
        """The latent weight's start: the float weight where it rounds to its starting code, else that code's level."""
        scale = scale.unsqueeze(-1)
        levels, index = self.levels, codes.long()
        if index.max() >= len(levels):
            raise ValueError(f"starting code {int(index.max())} is beyond this layout's {len(levels)} grid levels")
        level = levels[index]
        gaps = levels.diff()
        inf = torch.tensor([float("inf")])
        below = torch.cat([inf, gaps])[index] / 2  # distance from the level down to its cell's boundary
        above = torch.cat([gaps, inf])[index] / 2
        reach = 1 - _CELL_MARGIN
        t = grouped / scale + zero
        inside = (t - level >= -below * reach) & (t - level <= above * reach)
        base = (torch.where(inside, t, level) - zero) * scale
        if not torch.equal(self.layout.encode(base, scale, None if isinstance(zero, float) else zero), codes):
            raise ValueError("the starting codes are not on this layout's grid (they do not round back to themselves)")
        return base


class FakeQuantLinear(nn.Module):
    """A Linear layer computing with a `FakeQuantizedWeight` (its bias kept fixed, as quantized layers keep it)."""

    def __init__(self, weight: FakeQuantizedWeight, bias: torch.Tensor | None, input_rotation: int = 0) -> None:
        super().__init__()
        self.weight_quantizer = weight
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.shared_weight: torch.Tensor | None = None  # set by `weights_computed_once`
        self.input_rotation = input_rotation  # the quantized layer's (`quantlab.nn.rotation`); 0: none

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_rotation:
            x = rotate(x, self.input_rotation)
        weight = self.shared_weight if self.shared_weight is not None else self.weight_quantizer()
        return F.linear(x, weight.to(x.dtype), self.bias)


@contextlib.contextmanager
def weights_computed_once(module: nn.Module) -> Iterator[None]:
    """Inside, every `FakeQuantLinear` of `module` computes its weight once and uses it (and its autograd
    graph) for each forward: a training step over several batches pays for the fake quantizers once, and
    one backward of the summed loss reaches them once."""
    layers = [layer for layer in module.modules() if isinstance(layer, FakeQuantLinear)]
    for layer in layers:
        layer.shared_weight = layer.weight_quantizer()
    try:
        yield
    finally:
        for layer in layers:
            layer.shared_weight = None


class _StraightThrough(torch.autograd.Function):
    """The stored weight `hard`, with LSQ's straight-through gradients, in one pass.

    In the code domain `t = latent / scale + zero` and the weight is `scale * (level - zero)`, where
    `level` is the grid level `t` rounds to. Treating the rounding as the identity (and the clipping to
    the grid's range as a clamp) gives, per weight: `d w / d latent = inside`, `d w / d scale = level - t`
    inside the range and `level - zero` outside, `d w / d zero = -scale` outside and 0 inside. Saving
    one flag and one float per weight, instead of the intermediates of that expression written out with
    detached terms, keeps a training step's memory and time down (every weight of a model trains at once)."""

    @staticmethod
    def forward(ctx, latent, learned_scale, learned_zero, hard, scale, zero, level, low, high):
        t = latent / scale
        t += zero
        inside = torch.eq(t.clamp(low, high), t)
        scale_gradient = level - torch.where(inside, t, zero)
        ctx.save_for_backward(inside, scale_gradient, scale)
        ctx.learned_zero = learned_zero is not None
        return hard

    @staticmethod
    def backward(ctx, grad):
        inside, scale_gradient, scale = ctx.saved_tensors
        grad_latent = torch.where(inside, grad, 0.0)
        grad_scale = (grad * scale_gradient).sum(-1, keepdim=True)
        grad_zero = None
        if ctx.learned_zero:
            grad_zero = -(grad - grad_latent).sum(-1, keepdim=True) * scale
        return grad_latent, grad_scale, grad_zero, None, None, None, None, None, None


def _unsqueezed(values: torch.Tensor) -> torch.Tensor:
    return values.unsqueeze(-1)
