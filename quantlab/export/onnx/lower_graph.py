"""Replace the placeholder nodes of an exported graph by each layer's onnxruntime operators."""

from collections import Counter

import onnx_ir as ir

from quantlab.export.onnx import codec_lowerings  # noqa: F401  (registers the built-in lowerings)
from quantlab.export.onnx.errors import ExportError
from quantlab.export.onnx.expert_lowering import lower_experts, projection_names
from quantlab.export.onnx.lowering import MS_DOMAIN, LayerLowering, lowering_for
from quantlab.export.onnx.placeholder import DOMAIN, EXPERTS_OP_TYPE, OP_TYPE
from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_experts import QuantizedExperts

Layers = dict[str, QuantizedLinear | QuantizedExperts]


def lower_placeholders(model: ir.Model, layers: Layers, accuracy_level: int = 0) -> dict[str, str]:
    """Lower every placeholder in place; returns the operator used per layer name (per `<module>.<projection>`
    for quantized experts)."""
    graph = model.graph
    operators: dict[str, str] = {}
    created: dict[str, ir.Value] = {}
    for node in list(graph):
        if node.domain != DOMAIN or node.op_type not in (OP_TYPE, EXPERTS_OP_TYPE):
            continue
        name = node.attributes["layer"].as_string()
        ctx = LayerLowering(name=name, x=node.inputs[0], graph=graph, created=created, accuracy_level=accuracy_level)
        if node.op_type == OP_TYPE:
            out = _lower_linear(ctx, _layer(layers, name, QuantizedLinear))
        else:
            module_name, _, projection = name.rpartition(".")
            out, chosen = lower_experts(node, _layer(layers, module_name, QuantizedExperts), projection, ctx)
            ctx.operator = "/".join(sorted(chosen))
        ir.convenience.replace_nodes_and_values(graph, node, [node], ctx.tape.nodes, [node.outputs[0]], [out])
        operators[name] = ctx.operator
    missing = sorted(set(_expected_names(layers)) - set(operators))
    if missing:
        raise ExportError(f"{missing[0]}: quantized layer never reached by the model's forward pass, so not exported")
    model.opset_imports.pop(DOMAIN, None)
    if any(node.domain == MS_DOMAIN for node in graph):
        model.opset_imports[MS_DOMAIN] = 1
    return operators


def _layer(layers: Layers, name: str, kind: type) -> QuantizedLinear | QuantizedExperts:
    if not isinstance(layers.get(name), kind):
        raise ExportError(f"{name}: the exported graph names a quantized layer the model does not have")
    return layers[name]


def _lower_linear(ctx: LayerLowering, layer: QuantizedLinear) -> ir.Value:
    if getattr(layer, "input_rotation", 0):
        ctx.rotate_input(layer)
    return lowering_for(ctx.name, layer)(ctx, layer)


def _expected_names(layers: Layers) -> list[str]:
    """The placeholder names the graph must hold: each layer's, and each projection of each experts module."""
    names = []
    for name, module in layers.items():
        names += projection_names(name) if isinstance(module, QuantizedExperts) else [name]
    return names


def operator_counts(model: ir.Model) -> Counter:
    """Node types of the graph, `domain::op` for non-standard domains."""
    return Counter(f"{node.domain}::{node.op_type}" if node.domain else node.op_type for node in model.graph)
