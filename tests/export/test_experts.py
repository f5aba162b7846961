"""A mixture of experts' quantized projections lower, expert by expert, to the operator a Linear layer of the same
format gets, from each expert's own codes, and onnxruntime computes what each expert's kernel computes.

The lowering is checked alone here, on a graph holding the two placeholders of one `QuantizedExperts` (milliseconds
per format); whole mixtures of experts, routers included, are exported in `test_architectures.py`.
"""

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

import quantlab
from quantlab.export.onnx.lower_graph import lower_placeholders
from quantlab.export.onnx.placeholder import DOMAIN, EXPERTS_OP_TYPE, dense_routing
from quantlab.nn.quantized_experts import QuantizedExperts

EXPERTS, HIDDEN, INTERMEDIATE, TOKENS = 4, 64, 96, 7
FORMATS = {
    "affine2": quantlab.CustomBitsConfig(bits=2, group_size=32),
    "affine3-sym": quantlab.CustomBitsConfig(bits=3, group_size=64, symmetric=True),
    "affine4": quantlab.CustomBitsConfig(bits=4, group_size=32),
    "affine4-channel": quantlab.CustomBitsConfig(bits=4, group_size=None),
    "affine8": quantlab.CustomBitsConfig(bits=8, group_size=32),
    "int8": quantlab.Int8SymmetricConfig(),
    "nf4": quantlab.NF4Config(blocksize=32, double_quant=False),
    "nf4-double": quantlab.NF4Config(blocksize=64),
    "iq4_nl": quantlab.IQ4NLConfig(),
    "lut3": quantlab.LutConfig(bits=3, group_size=32),
}


def _experts(config: quantlab.QuantlabConfig) -> QuantizedExperts:
    torch.manual_seed(0)
    float_config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS)
    experts = MixtralExperts(float_config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    layer_class = quantlab.registry.method_of(config).module_class
    return QuantizedExperts.from_float(experts, layer_class, {"gate_up_proj": config, "down_proj": config}, "experts")


def _placeholder(x: ir.Value, projection: str, per_expert: bool, out_features: int) -> ir.Node:
    attributes = [ir.AttrString("layer", f"experts.{projection}"), ir.AttrInt64("per_expert", int(per_expert))]
    node = ir.Node(DOMAIN, EXPERTS_OP_TYPE, [x], attributes)
    node.outputs[0].name = projection
    node.outputs[0].dtype = ir.DataType.FLOAT
    node.outputs[0].shape = ir.Shape([EXPERTS, "tokens", out_features])
    return node


def _lowered(experts: QuantizedExperts) -> tuple[ir.Model, dict[str, str]]:
    """Both projections' placeholders, as the exporter writes them, lowered: `x` [tokens, hidden] → `gate_up_proj`
    [experts, tokens, 2 * intermediate]; `h` [experts, tokens, intermediate] → `down_proj` [experts, tokens, hidden]."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["tokens", HIDDEN]))
    h = ir.val("h", ir.DataType.FLOAT, ir.Shape([EXPERTS, "tokens", INTERMEDIATE]))
    nodes = [_placeholder(x, "gate_up_proj", False, 2 * INTERMEDIATE), _placeholder(h, "down_proj", True, HIDDEN)]
    graph = ir.Graph([x, h], [node.outputs[0] for node in nodes], nodes=nodes, opset_imports={"": 20, DOMAIN: 1})
    model = ir.Model(graph, ir_version=10)
    return model, lower_placeholders(model, {"experts": experts})


@pytest.mark.parametrize("config", list(FORMATS.values()), ids=list(FORMATS))
def test_each_expert_computes_with_its_own_codes(config, helpers) -> None:
    experts = _experts(config)
    model, operators = _lowered(experts)
    linear = quantlab.quantize(torch.nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False), config)
    assert set(operators.values()) == {helpers.layer_model(linear)[1]}  # the operator of a Linear of the format
    assert set(operators) == {"experts.gate_up_proj", "experts.down_proj"}

    stored = sum(value.const_value.nbytes for name, value in model.graph.initializers.items() if "experts." in name)
    assert stored <= 1.5 * experts.stored_bytes() + 512 * 2 * EXPERTS  # codes, not a float copy of the weights
    assert stored < 4 * 3 * INTERMEDIATE * HIDDEN * EXPERTS

    x, h = torch.randn(TOKENS, HIDDEN), torch.randn(EXPERTS, TOKENS, INTERMEDIATE)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString())
    gate_up, down = session.run(["gate_up_proj", "down_proj"], {"x": x.numpy(), "h": h.numpy()})
    with torch.no_grad():
        expected_gate_up = torch.stack([expert(x) for expert in experts.slices("gate_up_proj")])
        expected_down = torch.stack([expert(h[e]) for e, expert in enumerate(experts.slices("down_proj"))])
    for ours, expected in ((gate_up, expected_gate_up), (down, expected_down)):
        assert np.abs(ours - expected.numpy()).max() <= 1e-4 * max(1.0, expected.abs().max().item())


def test_dense_routing_weights_only_the_chosen_experts() -> None:
    top_k = torch.tensor([[0, 2], [3, 1], [2, 4]])  # 4: no expert of this module, as QuantizedExperts skips it
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]])
    expected = torch.tensor([[0.7, 0.0, 0.3, 0.0], [0.0, 0.4, 0.0, 0.6], [0.0, 0.0, 0.9, 0.0]])
    assert torch.equal(dense_routing(top_k, weights, EXPERTS), expected)
