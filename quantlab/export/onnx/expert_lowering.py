"""Lowering a mixture of experts' quantized projections: each expert's slice lowered as its Linear layer would be.

`QuantizedExperts` stores each expert's slice of a projection exactly as the method's `QuantizedLinear`
stores that weight, stacked on a leading expert axis. The placeholder of one projection
(`quantlab.export::QuantizedExperts`, see `placeholder.py`) becomes, for every expert, the nodes the
layer's own lowering builds from that expert's codes (`MatMulNBits`, `MatMulBnb4` or the unpacking
fallback; initializers `<module>.<projection>.<expert>.*`), and the outputs stacked `[experts, ..., out]`.

The graph computes all experts on every token, and the routing weights, scattered into a dense
`[tokens, experts]` matrix with zeros for the experts a token was not routed to, combine them: E/k
times the routed compute (8 experts, top-2: four times). Running only the routed experts needs a
gather of each expert's tokens whose sizes depend on the router's choices, a loop over data-dependent
shapes that neither torch.export nor a static onnxruntime graph expresses; computing every expert keeps
one static graph whose every matmul multiplies by a layer's own low-bit codes.
"""

import onnx_ir as ir
import torch

from quantlab.export.onnx.errors import ExportError
from quantlab.export.onnx.lowering import LayerLowering, lowering_for
from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_experts import PROJECTIONS, QuantizedExperts


def projection_names(name: str) -> list[str]:
    """The placeholder names of the projections of the experts module `name`: `<name>.<projection>`."""
    return [f"{name}.{projection}" for projection in PROJECTIONS]


def expert_layers(experts: QuantizedExperts, projection: str) -> list[QuantizedLinear]:
    """Each expert's slice of `projection` as a layer of the method's class holding that slice's stored tensors
    (views, no copy), so the lowering of that class and layout applies to it unchanged."""
    return [expert_layer(experts, projection, expert) for expert in range(experts.num_experts)]


def expert_layer(experts: QuantizedExperts, projection: str, expert: int) -> QuantizedLinear:
    """One expert's slice of `projection` as a layer of the method's class (built on the meta device, then
    given the slice's views: nothing is allocated)."""
    layout, config = experts.layouts[projection], experts.configs[projection]
    layer = experts.layer_class(layout.in_features, layout.out_features, bias=False, config=config, device="meta")
    for name, tensor in experts.slices(projection)[expert].stored_tensors().items():
        setattr(layer, name, tensor)
    return layer


def lower_experts(
    node: ir.Node, experts: QuantizedExperts, projection: str, ctx: LayerLowering
) -> tuple[ir.Value, set[str]]:
    """Every expert's output `[experts, ..., out]` of the placeholder `node` (on `ctx`'s tape), and the operators.

    With `per_expert`, the input has an expert axis (`[experts, ..., in]`, the down projection's input) and
    expert `e` reads its row `e`; otherwise every expert reads the one input.
    """
    per_expert = bool(node.attributes["per_expert"].as_int())
    layers = expert_layers(experts, projection)
    inputs = _expert_inputs(ctx, len(layers)) if per_expert else [ctx.x] * len(layers)
    axis = ctx.constant("expert_axis", [0], torch.int64)
    outputs, operators = [], set()
    for expert, (layer, x) in enumerate(zip(layers, inputs, strict=True)):
        name = f"{ctx.name}.{expert}"
        expert_ctx = LayerLowering(
            name=name, x=x, graph=ctx.graph, created=ctx.created, accuracy_level=ctx.accuracy_level, tape=ctx.tape
        )
        y = lowering_for(name, layer)(expert_ctx, layer)
        outputs.append(ctx.op("Unsqueeze", [y, axis]))
        operators.add(expert_ctx.operator)
    return ctx.op("Concat", outputs, axis=0), operators


def _expert_inputs(ctx: LayerLowering, count: int) -> list[ir.Value]:
    """Row `e` of the input `[experts, ..., in]` for each expert `e`, typed as the lowerings read their input."""
    x = ctx.x
    if x.shape is not None and isinstance(x.shape[0], int) and x.shape[0] != count:
        raise ExportError(f"{ctx.name}: the input holds {x.shape[0]} experts' rows, the module has {count} experts")
    sizes = ctx.constant("expert_split", [1] * count, torch.int64)
    split = ctx.tape.op_multi_out("Split", [x, sizes], {"axis": 0}, num_outputs=count)
    axis = ctx.constant("expert_axis", [0], torch.int64)
    rows = []
    for part in split:
        row = ctx.op("Squeeze", [part, axis])
        row.type = x.type
        row.shape = ir.Shape(x.shape[1:]) if x.shape is not None else None
        rows.append(row)
    return rows
