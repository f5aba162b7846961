"""Replace the placeholder nodes of an exported graph by each layer's onnxruntime operators."""

from collections import Counter

import onnx_ir as ir

from quantlab.export import builtin_lowerings  # noqa: F401  (registers the built-in lowerings)
from quantlab.export.errors import ExportError
from quantlab.export.lowering import MS_DOMAIN, LayerLowering, lowering_for
from quantlab.export.placeholder import DOMAIN, OP_TYPE
from quantlab.nn import QuantizedLinear


def lower_placeholders(model: ir.Model, layers: dict[str, QuantizedLinear], accuracy_level: int = 0) -> dict[str, str]:
    """Lower every placeholder in place; returns the operator used per layer name."""
    graph = model.graph
    operators: dict[str, str] = {}
    created: dict[str, ir.Value] = {}
    for node in list(graph):
        if node.domain != DOMAIN or node.op_type != OP_TYPE:
            continue
        name = node.attributes["layer"].as_string()
        if name not in layers:
            raise ExportError(f"{name}: the exported graph names a quantized layer the model does not have")
        x, y = node.inputs[0], node.outputs[0]
        ctx = LayerLowering(name=name, x=x, graph=graph, created=created, accuracy_level=accuracy_level)
        if getattr(layers[name], "input_rotation", 0):
            ctx.rotate_input(layers[name])
        out = lowering_for(name, layers[name])(ctx, layers[name])
        ir.convenience.replace_nodes_and_values(graph, node, [node], ctx.tape.nodes, [y], [out])
        operators[name] = ctx.operator
    missing = sorted(set(layers) - set(operators))
    if missing:
        raise ExportError(f"{missing[0]}: quantized layer never reached by the model's forward pass, so not exported")
    model.opset_imports.pop(DOMAIN, None)
    if any(node.domain == MS_DOMAIN for node in graph):
        model.opset_imports[MS_DOMAIN] = 1
    return operators


def operator_counts(model: ir.Model) -> Counter:
    """Node types of the graph, `domain::op` for non-standard domains."""
    return Counter(f"{node.domain}::{node.op_type}" if node.domain else node.op_type for node in model.graph)
