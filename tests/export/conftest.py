"""Tiny models and helpers for the ONNX export tests (given to tests by the `helpers` fixture)."""

from types import SimpleNamespace

import onnx_ir as ir
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantlab.export.onnx.lower_graph import lowering_for
from quantlab.export.onnx.lowering import LayerLowering
from quantlab.nn import QuantizedLinear
from quantlab.replacement import quantized_experts, quantized_layers


def small_llama(hidden_size: int = 64, intermediate_size: int = 96, layers: int = 1, seed: int = 0) -> LlamaForCausalLM:
    """A Llama small enough to export in seconds.

    The defaults give Linear layers with 64 and 96 input features: 96 is not a multiple of a
    group of 64, so groups are padded. `hidden_size=72` gives K=72, with no power-of-two
    factor of 16 or more (NF4 then needs the fallback), as does `intermediate_size=120`.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def padded_batch(seed: int = 1, batch: int = 3, length: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids with a left-padded row, the layout batched generation uses."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def max_logit_error(model, onnx_logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |ORT - PyTorch| over the positions that are not padding, PyTorch given the positions batched
    generation gives a left-padded row (as the export computes them): a model with learned absolute positions
    (GPT-2) does not derive them from the mask."""
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return float((onnx_logits - reference)[mask.bool()].abs().max())


def layer_initializer_bytes(path, model) -> dict[str, int]:
    """Bytes of the initializers each quantized layer (and quantized experts module) owns in the ONNX file
    (named `<layer>.*`)."""
    graph = ir.load(path).graph
    sizes = dict.fromkeys([*quantized_layers(model), *quantized_experts(model)], 0)
    for name, value in graph.initializers.items():
        for layer in sizes:
            if name.startswith(layer + "."):
                sizes[layer] += value.const_value.nbytes
    return sizes


def layer_model(layer: QuantizedLinear) -> tuple[ir.Model, str]:
    """One quantized layer lowered into a model of its own (`x` -> `y`), and the operator chosen."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["rows", layer.in_features]))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 20, "com.microsoft": 1})
    ctx = LayerLowering(name="layer", x=x, graph=graph, created={})
    y = lowering_for("layer", layer)(ctx, layer)
    y.dtype, y.shape = ir.DataType.FLOAT, ir.Shape(["rows", layer.out_features])
    graph.extend(ctx.tape.nodes)
    graph.outputs.append(y)
    return ir.Model(graph, ir_version=10), ctx.operator


@pytest.fixture
def helpers() -> SimpleNamespace:
    return SimpleNamespace(
        small_llama=small_llama,
        padded_batch=padded_batch,
        max_logit_error=max_logit_error,
        layer_initializer_bytes=layer_initializer_bytes,
        layer_model=layer_model,
    )


@pytest.fixture
def onnx_path(tmp_path):
    return tmp_path / "model.onnx"
