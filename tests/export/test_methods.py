"""Every built-in method lowers to the onnxruntime operator the lowering table names, keeps its
low-bit weights (not float copies), and onnxruntime computes what PyTorch computes.

Each configuration is checked twice: its layer alone, lowered into a one-layer model (fast,
no exporter), and inside a whole model exported by `to_onnx`, where one export carries a
different configuration in every Linear layer (an export takes seconds; a layer, milliseconds).
"""

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import quantlab
from quantlab.export import ExportError, OnnxCausalLM, to_onnx
from quantlab.replacement import quantized_layers
from quantlab.testing import tiny_llama

NBITS, BNB4, FALLBACK = "MatMulNBits", "MatMulBnb4", "fallback"
_NODE = {NBITS: "com.microsoft::MatMulNBits", BNB4: "com.microsoft::MatMulBnb4"}


def _custom_bits_cases() -> list[tuple[str, quantlab.QuantlabConfig, str]]:
    cases = []
    for bits in range(2, 9):
        for symmetric in (True, False):
            native = bits in (2, 4) or (bits == 8 and symmetric)
            config = quantlab.CustomBitsConfig(bits=bits, symmetric=symmetric)
            cases.append((f"cb{bits}-{'sym' if symmetric else 'asym'}", config, NBITS if native else FALLBACK))
    return cases


CUSTOM_BITS = _custom_bits_cases()
OTHERS = [
    ("int8-per-channel", quantlab.Int8SymmetricConfig(), NBITS),
    ("int8-g32-fp16", quantlab.Int8SymmetricConfig(group_size=32, scale_dtype="float16"), NBITS),
    ("nf4-double-quant", quantlab.NF4Config(), BNB4),
    ("nf4", quantlab.NF4Config(double_quant=False), BNB4),
    ("nf4-blocks-wider-than-ort", quantlab.NF4Config(blocksize=512), BNB4),
    ("cb4-per-channel-asym", quantlab.CustomBitsConfig(bits=4, group_size=None), NBITS),
    ("cb3-per-channel-asym", quantlab.CustomBitsConfig(bits=3, group_size=None), FALLBACK),
    ("cb8-sym-bf16", quantlab.CustomBitsConfig(bits=8, symmetric=True, scale_dtype="bfloat16"), NBITS),
    ("iq4_nl", quantlab.IQ4NLConfig(), FALLBACK),
    ("lut4", quantlab.LutConfig(), FALLBACK),
    ("lut3-g32", quantlab.LutConfig(bits=3, group_size=32), FALLBACK),
]
# K=72 and K=120 have no power-of-two factor >= 16: MatMulBnb4 cannot tile them.
ODD_K = [
    ("nf4-K72-fallback", quantlab.NF4Config(), FALLBACK),
    ("cb4-g32-K72", quantlab.CustomBitsConfig(bits=4, group_size=32), NBITS),
]


# -- one layer at a time ------------------------------------------------------------------------


@pytest.mark.parametrize("in_features", [64, 96, 72])
@pytest.mark.parametrize(
    ("config", "operator"),
    [pytest.param(c, op, id=name) for name, c, op in CUSTOM_BITS + OTHERS + ODD_K],
)
def test_layer_computes_with_its_own_weights(config, operator, in_features, helpers) -> None:
    torch.manual_seed(in_features)
    linear = torch.nn.Linear(in_features, 40, bias=in_features != 64)
    layer = quantlab.quantize(linear, config)
    model, chosen = helpers.layer_model(layer)
    if isinstance(config, quantlab.NF4Config):  # MatMulBnb4 needs a block of 16+ that tiles K
        operator = BNB4 if in_features % 16 == 0 else FALLBACK
    assert chosen == operator

    # The model carries the stored codes: at most the layer's own bytes plus float32 copies of
    # scales and bias (a float copy of the weight would be 4 bytes per weight). Initializers that
    # layers of equal shape share (the block-sum matrix of the zero-point correction) are not counted.
    initializers = model.graph.initializers.values()
    stored = sum(value.const_value.nbytes for value in initializers if value.name.startswith("layer."))
    bias = 0 if linear.bias is None else 4 * 40
    assert stored <= 1.5 * layer.stored_bytes() + bias + 512
    assert stored < 4 * in_features * 40

    x = torch.randn(5, in_features)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString())
    (y,) = session.run(None, {"x": x.numpy()})
    with torch.no_grad():
        expected = layer(x).numpy()
    assert np.abs(y - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())


# -- whole models, one configuration per layer --------------------------------------------------


def _mixed_model(helpers, cases, **shape):
    """A small Llama whose Linear layers take the configurations of `cases` in turn (lm_head stays float)."""
    model = helpers.small_llama(**shape)
    names = [name for name, module in model.named_modules() if type(module) is torch.nn.Linear and name != "lm_head"]
    expected = {}
    for name, (_, config, operator) in zip(names, cases, strict=False):
        quantlab.quantize(model, config, modules=[name])
        expected[name] = operator
    return model, expected


@pytest.mark.parametrize(
    ("cases", "shape"),
    [
        pytest.param(CUSTOM_BITS, {}, id="custom-bits-2-to-8-sym-asym"),
        pytest.param(OTHERS, {}, id="int8-nf4-per-channel"),
        pytest.param(ODD_K * 7, {"layers": 1, "hidden_size": 72, "intermediate_size": 120}, id="K72-K120"),
    ],
)
def test_model_with_every_method_matches_pytorch(cases, shape, onnx_path, helpers) -> None:
    model, expected = _mixed_model(helpers, cases, **shape)
    assert len(expected) == min(len(cases), 7 * model.config.num_hidden_layers)
    result = to_onnx(model, onnx_path)
    assert result.layer_operators == expected

    counts = {op: list(expected.values()).count(op) for op in set(expected.values())}
    low_bit_nodes = {op: n for op, n in result.operators.items() if op.startswith("com.microsoft::")}
    assert low_bit_nodes == {_NODE[op]: n for op, n in counts.items() if op in _NODE}

    stored = helpers.layer_initializer_bytes(onnx_path, model)
    for name, layer in quantized_layers(model).items():
        assert stored[name] <= 1.5 * layer.stored_bytes() + 512, name

    ids, mask = helpers.padded_batch()
    assert helpers.max_logit_error(model, OnnxCausalLM(onnx_path)(ids, mask), ids, mask) <= 1e-3


def test_float_model_exports_standard_onnx(onnx_path, helpers) -> None:
    model = helpers.small_llama()
    result = to_onnx(model, onnx_path)
    assert result.layer_operators == {}
    assert not any(op.startswith("com.microsoft::") for op in result.operators)
    ids, mask = helpers.padded_batch()
    assert helpers.max_logit_error(model, OnnxCausalLM(onnx_path)(ids, mask), ids, mask) <= 1e-4


def test_quantized_and_tied_lm_head_export(onnx_path, helpers) -> None:
    model = tiny_llama(tie_word_embeddings=True)
    quantlab.quantize(model, quantlab.CustomBitsConfig(bits=4, modules_to_not_convert=[]))
    result = to_onnx(model, onnx_path)
    assert result.layer_operators["lm_head"] == NBITS
    assert result.output_names == ["logits"]
    ids, mask = helpers.padded_batch()
    assert helpers.max_logit_error(model, OnnxCausalLM(onnx_path)(ids, mask), ids, mask) <= 1e-3


def test_int8_activations_on_request_and_the_model_left_as_it_was(onnx_path, helpers) -> None:
    model = quantlab.quantize(helpers.small_llama(), quantlab.Int8SymmetricConfig())
    model.train()
    model.model.layers[0].mlp.eval()
    before = {name: (type(module), module.training) for name, module in model.named_modules()}
    result = to_onnx(model, onnx_path, accuracy_level=4)
    assert {name: (type(module), module.training) for name, module in model.named_modules()} == before
    model.eval()
    assert result.accuracy_level == 4
    nodes = [node for node in ir.load(onnx_path).graph if node.op_type == "MatMulNBits"]
    assert len(nodes) == 7 and all(node.attributes["accuracy_level"].as_int() == 4 for node in nodes)
    ids, mask = helpers.padded_batch()
    error = helpers.max_logit_error(model, OnnxCausalLM(onnx_path)(ids, mask), ids, mask)
    assert 0 < error <= 0.05  # int8 activations: close to PyTorch, no longer within float rounding


def test_invalid_accuracy_level_is_refused(onnx_path, helpers) -> None:
    with pytest.raises(ExportError, match="accuracy_level=5 is not valid"):
        to_onnx(helpers.small_llama(), onnx_path, accuracy_level=5)
