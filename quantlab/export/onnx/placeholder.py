"""Placeholder nodes that stand for quantized layers while `torch.onnx.export` traces the model.

Each quantized layer is swapped, for the duration of the export, for a module calling the
custom op `quantlab_export::quantized_linear(x, layer, out_features)`. The exporter translates
it into a node `quantlab.export::QuantizedLinear(x) {layer=...}`: no weight enters the traced
graph, and the exporter's optimizer cannot constant-fold what it does not know. `lower_graph.py`
then replaces each placeholder by the layer's onnxruntime operators.

A mixture of experts' `QuantizedExperts` is swapped for `QuantizedExpertsPlaceholder`, whose two
projections are nodes `quantlab.export::QuantizedExperts(x) {layer=<module>.<projection>}` giving
every expert's output `[experts, ..., out]` (lowered in `experts.py`); the activation between them
and the combination by the routing weights are traced as torch operations.
"""

import contextlib
from collections.abc import Iterator

import onnx
import onnxscript
import torch
from torch import nn

from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_experts import QuantizedExperts

DOMAIN = "quantlab.export"
OP_TYPE = "QuantizedLinear"
EXPERTS_OP_TYPE = "QuantizedExperts"


@torch.library.custom_op("quantlab_export::quantized_linear", mutates_args=())
def quantized_linear(x: torch.Tensor, layer: str, out_features: int) -> torch.Tensor:
    raise RuntimeError(f"{layer}: quantlab's export placeholder only exists while torch.onnx.export traces the model")


@quantized_linear.register_fake
def _quantized_linear_shape(x: torch.Tensor, layer: str, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("quantlab_export::quantized_experts", mutates_args=())
def quantized_experts(x: torch.Tensor, layer: str, experts: int, out_features: int, per_expert: bool) -> torch.Tensor:
    raise RuntimeError(f"{layer}: quantlab's export placeholder only exists while torch.onnx.export traces the model")


@quantized_experts.register_fake
def _quantized_experts_shape(
    x: torch.Tensor, layer: str, experts: int, out_features: int, per_expert: bool
) -> torch.Tensor:
    """Every expert's output `[experts, ..., out]`, of one input `[..., in]` or one per expert `[experts, ..., in]`."""
    rows = x.shape[1:-1] if per_expert else x.shape[:-1]
    return x.new_empty((experts, *rows, out_features))


def _register_schema(op_type: str, doc: str, attributes: list[onnx.defs.OpSchema.Attribute]) -> None:
    """onnxscript builds nodes from schemas, so each placeholder needs one (registered once)."""
    if onnx.defs.has(op_type, DOMAIN):
        return
    schema = onnx.defs.OpSchema(
        op_type,
        DOMAIN,
        1,
        doc=doc,
        inputs=[onnx.defs.OpSchema.FormalParameter("X", "T")],
        outputs=[onnx.defs.OpSchema.FormalParameter("Y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations")],
        attributes=attributes,
    )
    onnx.defs.register_schema(schema)


_LAYER = onnx.defs.OpSchema.Attribute("layer", onnx.defs.OpSchema.AttrType.STRING, "layer name")
_PER_EXPERT = onnx.defs.OpSchema.Attribute("per_expert", onnx.defs.OpSchema.AttrType.INT, "1: X has an expert axis")
_AFTER = "replaced by onnxruntime operators after export."
_register_schema(OP_TYPE, f"A quantlab quantized Linear layer, {_AFTER}", [_LAYER])
_register_schema(
    EXPERTS_OP_TYPE, f"One projection of every expert of a quantlab QuantizedExperts, {_AFTER}", [_LAYER, _PER_EXPERT]
)
_OPSET = onnxscript.values.Opset(DOMAIN, 1)


def _translate(x, layer: str, out_features: int):
    return _OPSET.QuantizedLinear(x, layer=layer)


def _translate_experts(x, layer: str, experts: int, out_features: int, per_expert: bool):
    return _OPSET.QuantizedExperts(x, layer=layer, per_expert=int(per_expert))


TRANSLATION_TABLE = {
    torch.ops.quantlab_export.quantized_linear.default: _translate,
    torch.ops.quantlab_export.quantized_experts.default: _translate_experts,
}


class QuantizedLinearPlaceholder(nn.Module):
    def __init__(self, layer: str, out_features: int) -> None:
        super().__init__()
        self.layer = layer
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.layer, self.out_features)


class QuantizedExpertsPlaceholder(nn.Module):
    """Stands for a `QuantizedExperts`: every expert computes every token, and the routing weights
    scattered into a dense `[..., experts]` matrix (zeros for the experts a token was not routed to)
    combine them. A static graph has no data-dependent gather of tokens per expert (see `experts.py`)."""

    def __init__(self, layer: str, experts: QuantizedExperts) -> None:
        super().__init__()
        self.layer = layer
        self.num_experts = experts.num_experts
        self.hidden_size, self.intermediate_size = experts.hidden_size, experts.intermediate_size
        self.act_fn = experts.act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        experts, intermediate = self.num_experts, self.intermediate_size
        gate_up = quantized_experts(hidden_states, f"{self.layer}.gate_up_proj", experts, 2 * intermediate, False)
        gate, up = gate_up.chunk(2, dim=-1)
        down = quantized_experts(self.act_fn(gate) * up, f"{self.layer}.down_proj", experts, self.hidden_size, True)
        routing = dense_routing(top_k_index, top_k_weights, experts)
        return (down * routing.movedim(-1, 0).unsqueeze(-1)).sum(0).to(hidden_states.dtype)


def dense_routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int) -> torch.Tensor:
    """`[..., experts]`: each token's weight for each expert, 0 where the top-k did not pick it (an index
    outside `[0, experts)` picks none, as in `QuantizedExperts`)."""
    chosen = top_k_index.unsqueeze(-1) == torch.arange(experts, device=top_k_index.device)
    return (chosen.to(top_k_weights.dtype) * top_k_weights.unsqueeze(-1)).sum(-2)


@contextlib.contextmanager
def placeholders(model: nn.Module) -> Iterator[dict[str, QuantizedLinear | QuantizedExperts]]:
    """Swap every quantized layer and quantized experts module of `model` for a placeholder; yields them
    by name, restores them on exit."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear | QuantizedExperts)}
    try:
        for name, module in layers.items():
            if isinstance(module, QuantizedExperts):
                model.set_submodule(name, QuantizedExpertsPlaceholder(name, module))
            else:
                model.set_submodule(name, QuantizedLinearPlaceholder(name, module.out_features))
        yield layers
    finally:
        for name, module in layers.items():
            model.set_submodule(name, module)
