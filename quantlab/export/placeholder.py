"""Placeholder nodes that stand for quantized layers while `torch.onnx.export` traces the model.

Each quantized layer is swapped, for the duration of the export, for a module calling the
custom op `quantlab_export::quantized_linear(x, layer, out_features)`. The exporter translates
it into a node `quantlab.export::QuantizedLinear(x) {layer=...}`: no weight enters the traced
graph, and the exporter's optimizer cannot constant-fold what it does not know. `lower.py`
then replaces each placeholder by the layer's onnxruntime operators.
"""

import contextlib
from collections.abc import Iterator

import onnx
import onnxscript
import torch
from torch import nn

from quantlab.nn import QuantizedLinear

DOMAIN = "quantlab.export"
OP_TYPE = "QuantizedLinear"


@torch.library.custom_op("quantlab_export::quantized_linear", mutates_args=())
def quantized_linear(x: torch.Tensor, layer: str, out_features: int) -> torch.Tensor:
    raise RuntimeError(f"{layer}: quantlab's export placeholder only exists while torch.onnx.export traces the model")


@quantized_linear.register_fake
def _quantized_linear_shape(x: torch.Tensor, layer: str, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _register_schema() -> None:
    """onnxscript builds nodes from schemas, so the placeholder needs one (registered once)."""
    if onnx.defs.has(OP_TYPE, DOMAIN):
        return
    schema = onnx.defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        1,
        doc="A quantlab quantized Linear layer, replaced by onnxruntime operators after export.",
        inputs=[onnx.defs.OpSchema.FormalParameter("X", "T")],
        outputs=[onnx.defs.OpSchema.FormalParameter("Y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations")],
        attributes=[onnx.defs.OpSchema.Attribute("layer", onnx.defs.OpSchema.AttrType.STRING, "layer name")],
    )
    onnx.defs.register_schema(schema)


_register_schema()
_OPSET = onnxscript.values.Opset(DOMAIN, 1)


def _translate(x, layer: str, out_features: int):
    return _OPSET.QuantizedLinear(x, layer=layer)


TRANSLATION_TABLE = {torch.ops.quantlab_export.quantized_linear.default: _translate}


class QuantizedLinearPlaceholder(nn.Module):
    def __init__(self, layer: str, out_features: int) -> None:
        super().__init__()
        self.layer = layer
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.layer, self.out_features)


@contextlib.contextmanager
def placeholders(model: nn.Module, prefix: str = "") -> Iterator[dict[str, QuantizedLinear]]:
    """Swap every quantized layer of `model` for a placeholder; yields them by name, restores on exit.

    `prefix` is stripped from the names (the model is traced inside a wrapper).
    """
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    try:
        for name, module in layers.items():
            model.set_submodule(name, QuantizedLinearPlaceholder(name, module.out_features))
        yield layers
    finally:
        for name, module in layers.items():
            model.set_submodule(name, module)
