"""Every built-in method exports to the onnxruntime operator the lowering table names, stores its
low-bit weights (not float copies), and onnxruntime's logits match PyTorch's within 1e-3."""

import onnx_ir as ir
import pytest
import torch

import quantlab
from quantlab.convert import quantized_layers
from quantlab.export import ExportError, OnnxCausalLM, to_onnx

NBITS, BNB4, FALLBACK = "MatMulNBits", "MatMulBnb4", "fallback"

CASES = [
    pytest.param(quantlab.Int8SymmetricConfig(), NBITS, {}, id="int8-per-channel"),
    pytest.param(quantlab.Int8SymmetricConfig(group_size=32, scale_dtype="float16"), NBITS, {}, id="int8-g32-fp16"),
    pytest.param(quantlab.NF4Config(), BNB4, {}, id="nf4-double-quant"),
    pytest.param(quantlab.NF4Config(double_quant=False), BNB4, {}, id="nf4"),
    pytest.param(quantlab.NF4Config(blocksize=512), BNB4, {}, id="nf4-blocks-wider-than-ort"),
    pytest.param(quantlab.NF4Config(), FALLBACK, {"hidden_size": 72, "intermediate_size": 120}, id="nf4-K72-fallback"),
    pytest.param(quantlab.CustomBitsConfig(bits=4, group_size=None), NBITS, {}, id="cb4-per-channel-asym"),
    pytest.param(
        quantlab.CustomBitsConfig(bits=4, group_size=32),
        NBITS,
        {"hidden_size": 72, "intermediate_size": 120},
        id="cb4-K72-asym",
    ),
    pytest.param(quantlab.CustomBitsConfig(bits=3, group_size=None), FALLBACK, {}, id="cb3-per-channel-asym"),
    pytest.param(
        quantlab.CustomBitsConfig(bits=8, symmetric=True, scale_dtype="bfloat16"), NBITS, {}, id="cb8-sym-bf16"
    ),
]
for bits in range(2, 9):
    for symmetric in (True, False):
        native = bits in (2, 4) or (bits == 8 and symmetric)
        CASES.append(
            pytest.param(
                quantlab.CustomBitsConfig(bits=bits, symmetric=symmetric),
                NBITS if native else FALLBACK,
                {},
                id=f"cb{bits}-{'sym' if symmetric else 'asym'}",
            )
        )

_OPERATOR_NODES = {NBITS: "com.microsoft::MatMulNBits", BNB4: "com.microsoft::MatMulBnb4"}


@pytest.mark.parametrize(("config", "operator", "shape"), CASES)
def test_method_exports_with_its_own_weights(config, operator, shape, onnx_path, helpers) -> None:
    model = quantlab.quantize(helpers.small_llama(**shape), config)
    layers = quantized_layers(model)
    result = to_onnx(model, onnx_path)

    assert set(result.layer_operators.values()) == {operator}
    assert set(result.layer_operators) == set(layers)
    low_bit_nodes = {op: n for op, n in result.operators.items() if op.startswith("com.microsoft::")}
    assert low_bit_nodes == ({_OPERATOR_NODES[operator]: len(layers)} if operator in _OPERATOR_NODES else {})

    # The file carries the stored codes: at most the layer's own bytes plus float32 copies of the
    # scales (a float copy of a 64x64 weight alone would be 16 KiB).
    stored = helpers.layer_initializer_bytes(onnx_path, model)
    for name, layer in layers.items():
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


def test_quantized_lm_head_is_exported_too(onnx_path, helpers) -> None:
    model = quantlab.quantize(helpers.small_llama(), quantlab.CustomBitsConfig(bits=4, modules_to_not_convert=[]))
    result = to_onnx(model, onnx_path)
    assert result.layer_operators["lm_head"] == NBITS
    assert result.output_names == ["logits"]
    ids, mask = helpers.padded_batch()
    assert helpers.max_logit_error(model, OnnxCausalLM(onnx_path)(ids, mask), ids, mask) <= 1e-3


def test_model_is_left_as_it_was(onnx_path, helpers) -> None:
    model = quantlab.quantize(helpers.small_llama(), quantlab.NF4Config())
    model.train()
    before = {name: type(module) for name, module in model.named_modules()}
    to_onnx(model, onnx_path)
    assert {name: type(module) for name, module in model.named_modules()} == before
    assert model.training
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))


def test_int8_activations_on_request(onnx_path, helpers) -> None:
    model = quantlab.quantize(helpers.small_llama(), quantlab.Int8SymmetricConfig())
    result = to_onnx(model, onnx_path, accuracy_level=4)
    assert result.accuracy_level == 4
    nodes = [node for node in ir.load(onnx_path).graph if node.op_type == "MatMulNBits"]
    assert len(nodes) == 7 and all(node.attributes["accuracy_level"].as_int() == 4 for node in nodes)
    ids, mask = helpers.padded_batch()
    error = helpers.max_logit_error(model, OnnxCausalLM(onnx_path)(ids, mask), ids, mask)
    assert 0 < error <= 0.05  # int8 activations: close to PyTorch, no longer within float rounding


def test_invalid_accuracy_level_is_refused(onnx_path, helpers) -> None:
    with pytest.raises(ExportError, match="accuracy_level=5 is not valid"):
        to_onnx(helpers.small_llama(), onnx_path, accuracy_level=5)
