"""A mixture of experts' routed rows through each expert's quantized slice: the operator `quantlab::routed_linear`.

A mixture of experts stores one projection of all its experts stacked on a leading expert axis, each
expert's slice as a quantized Linear layer of its format stores it. `routed_linear` multiplies each
routed (token, slot) pair of `top_k_index` `[tokens, k]` by the slice of the expert in that slot: it
sorts the pairs by expert and runs each routed expert's rows through the kernel of its format
(`select_kernel`, on an `ExpertSlice`: views of the stacked tensors), experts that received no token
not at all. Which experts run, and how many rows each gets, depends on the values of `top_k_index`,
which torch.compile cannot trace without breaking the graph. As the operator `quantlab::routed_linear`
the routing is one opaque call whose output shape depends on input shapes only (its fake
implementation), so a compiled decode step holds a mixture of experts in one graph.

`QuantizedExperts` calls it once per projection: `gate_up_proj` on each token's row, then its own
activation (any module; an operator cannot take one) as ordinary torch operations, then `down_proj` on
each pair's row, weighted and summed per token in expert order, as a loop over the experts sums them.
It calls the operator when no gradient is asked for (eager forwards and compiled steps alike) and the
same function directly otherwise (the operator has no autograd formula; the kernels have).

The operator takes the layout in one line (`layout_text`: every field of the `StorageLayout` and of
its codec's options, read back by `parse_layout_text`) and the stacked stored tensors in the order
of `layout.tensors`; it knows no codec's tensors: the layout names them and the codec's kernel reads them.
"""

import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from quantlab.formats.codec import get_codec
from quantlab.formats.layout import StorageLayout
from quantlab.kernels import select_kernel


class ExpertSlice:
    """One expert's slice of one projection, as a kernel reads a quantized Linear layer: its layout and views
    of the stacked stored tensors (no copy)."""

    activation_bits: ClassVar[int] = 0
    input_rotation: ClassVar[int] = 0
    bias: ClassVar[None] = None

    def __init__(self, layout: StorageLayout, tensors: dict[str, torch.Tensor]) -> None:
        self.layout = layout
        self.in_features, self.out_features = layout.in_features, layout.out_features
        self._buffers = tensors
        self._parameters: dict[str, torch.Tensor] = {}

    @classmethod
    def of(cls, layout: StorageLayout, stored: Sequence[torch.Tensor], expert: int) -> "ExpertSlice":
        """The slice of `expert` in the stacked tensors `stored`, in the order of `layout.tensors`."""
        return cls(layout, {name: tensor[expert] for name, tensor in zip(layout.tensors, stored, strict=True)})

    @property
    def format(self) -> str:
        return self.layout.codec

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self._buffers)

    def dequantize_stored(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.layout.dequantize(self._buffers, dtype)

    dequantize_weight = dequantize_stored

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return select_kernel(self.layout.codec, x.device.type)(self, x)


def routed_linear(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor | None,
    layout: StorageLayout,
    stored: Sequence[torch.Tensor],
) -> torch.Tensor:
    """Each routed pair's row times its expert's slice of one projection (stacked `stored`, named by `layout`).

    `x` is one row per token `[tokens, in]` (every slot of a token reads it) or one per pair `[tokens, k, in]`.
    Without `top_k_weights` the result is each pair's row `[tokens, k, out]` (zeros where the slot names no
    expert of this module); with them, each token's pairs weighted and summed in expert order `[tokens, out]`.
    The pairs are sorted by expert (tokens in order within an expert) and gathered once; each routed expert
    then multiplies its run of rows, a view, through the kernel of its format.
    """
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    with torch.no_grad():
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique(flat, sorted=True, return_counts=True)
    per_pair = x.dim() > top_k_index.dim()
    grouped = x.reshape(tokens * k, -1)[order] if per_pair else x[order // k]
    products = []
    for expert, rows in zip(experts.tolist(), grouped.split(counts.tolist()), strict=True):
        if 0 <= expert < stored[0].shape[0]:
            products.append(ExpertSlice.of(layout, stored, expert)(rows).to(x.dtype))
        else:  # a slot this module has no expert for (another device's, under expert parallelism) adds nothing
            products.append(rows.new_zeros(rows.shape[0], layout.out_features))
    grouped = torch.cat(products) if products else x.new_zeros(0, layout.out_features)
    if top_k_weights is None:
        out = grouped.new_empty(tokens * k, layout.out_features).index_copy_(0, order, grouped)  # every pair once
        return out.view(tokens, k, layout.out_features)
    weighted = grouped * top_k_weights.reshape(-1)[order, None]
    return x.new_zeros(tokens, layout.out_features).index_add(0, order // k, weighted.to(x.dtype))


# -- the layout in one line -------------------------------------------------------------------------


def layout_text(layout: StorageLayout) -> str:
    """Every field of `layout` in one line of JSON (dtypes by name, tuples as lists), its codec's options as
    an object of their fields: a string operator argument."""
    return json.dumps({**_plain_fields(layout), "options": _plain_fields(layout.options)})


@functools.lru_cache(maxsize=256)
def parse_layout_text(text: str) -> StorageLayout:
    """The `StorageLayout` that `layout_text` wrote, its options rebuilt by its codec (`Codec.options`)."""
    fields = json.loads(text)
    options = {name: _typed(value) for name, value in fields.pop("options").items()}
    layout = {name: _typed(value) for name, value in fields.items()}
    return StorageLayout(**layout, options=get_codec(layout["codec"]).options(**options))


def _plain_fields(value: Any) -> dict[str, Any]:
    """A dataclass's fields as plain JSON values."""
    return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    return list(value) if isinstance(value, tuple) else value


def _typed(value: Any) -> Any:
    if isinstance(value, dict):
        return getattr(torch, value["dtype"])
    return tuple(value) if isinstance(value, list) else value


# -- the operator ---------------------------------------------------------------------------------------

torch.library.define(
    "quantlab::routed_linear",
    "(Tensor x, Tensor top_k_index, Tensor? top_k_weights, str layout, Tensor[] stored) -> Tensor",
)


@torch.library.impl("quantlab::routed_linear", "CompositeExplicitAutograd")
def _routed_linear(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None, layout: str, stored: list
) -> torch.Tensor:
    return routed_linear(x, top_k_index, top_k_weights, parse_layout_text(layout), stored)


@torch.library.register_fake("quantlab::routed_linear")
def _routed_linear_shape(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None, layout: str, stored: list
) -> torch.Tensor:
    shape = (top_k_index.shape[0],) if top_k_weights is not None else tuple(top_k_index.shape)
    return x.new_empty((*shape, parse_layout_text(layout).out_features))


routed_linear_op: torch._ops.OpOverload = torch.ops.quantlab.routed_linear.default
