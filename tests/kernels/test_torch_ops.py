"""The native kernels as torch operators: opcheck on every built-in codec, the same results as the
ctypes path and the reference, gradients, and torch.compile of a quantized model without graph breaks."""

import warnings

import pytest
import torch

import quantlab
from quantlab import CustomBitsConfig, Int8SymmetricConfig, IQ4NLConfig, LutConfig, NF4Config
from quantlab.kernels.cpu import extension, native, ops, tune
from quantlab.kernels.cpu.linear import ctypes_linear, native_dequantize, native_linear, native_matmul
from quantlab.kernels.cpu.weights import native_weight
from quantlab.kernels.reference import dequantize_matmul
from quantlab.testing.models import tiny_llama

CODECS = [
    *(CustomBitsConfig(bits=bits, group_size=32, symmetric=s) for bits in range(2, 9) for s in (True, False)),
    Int8SymmetricConfig(),
    Int8SymmetricConfig(group_size=32, scale_dtype="bfloat16"),
    NF4Config(blocksize=32, double_quant=True),
    NF4Config(blocksize=32, double_quant=False),
    IQ4NLConfig(),
    *(LutConfig(bits=bits, group_size=32) for bits in (2, 3, 4)),
]


def config_id(config) -> str:
    options = {k: v for k, v in vars(config).items() if k in ("bits", "symmetric", "group_size", "double_quant")}
    return f"{config.method}-" + "-".join(f"{k}={v}" for k, v in options.items())


def quantized(config, in_features: int = 80, out_features: int = 24, seed: int = 0):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features)
    return quantlab.get_method(config.method).module_class.from_linear(linear, config)


@pytest.fixture(scope="module")
def operators():
    if not ops.available():
        pytest.skip("quantlab's torch operators could not be built here (no C/C++ compiler?)")
    return ops


@pytest.mark.parametrize("config", CODECS, ids=config_id)
def test_opcheck(operators, config):
    layer = quantized(config)  # 80 inputs: no group size divides them (the last group is padded)
    weight = operators.weight_arguments(layer)
    for x in (torch.randn(3, 80, requires_grad=True), torch.randn(2, 3, 80).to(torch.bfloat16)):
        for bias in (layer.bias, None):
            torch.library.opcheck(operators.linear_op, (x, bias, *weight))
    torch.library.opcheck(operators.dequantize_op, weight)


@pytest.mark.parametrize("config", CODECS, ids=config_id)
def test_operators_compute_what_the_ctypes_path_and_the_reference_compute(operators, config):
    layer = quantized(config)
    assert torch.equal(operators.dequantize_op(*operators.weight_arguments(layer)), layer.dequantize_weight())
    assert torch.equal(
        operators.dequantize_op(*operators.weight_arguments(layer)), native_dequantize(native_weight(layer))
    )
    x = torch.randn(2, 5, 80)
    with torch.no_grad():
        out = native_linear(layer, x)
        assert torch.equal(out, ctypes_linear(layer, x) + layer.bias)  # the same C kernel behind both
        torch.testing.assert_close(out, dequantize_matmul(layer, x), rtol=0, atol=1e-4 * out.abs().max().item())


@pytest.mark.parametrize("config", [CODECS[7], CODECS[-2]], ids=config_id)
def test_gradients_for_input_and_bias_match_the_reference(operators, config):
    layer = quantized(config)
    layer.bias.requires_grad_(True)
    x = torch.randn(2, 4, 80)
    grads = []
    for kernel in (native_linear, dequantize_matmul):
        leaf = x.clone().requires_grad_(True)
        layer.bias.grad = None
        kernel(layer, leaf).square().sum().backward()
        grads.append((leaf.grad, layer.bias.grad.clone()))
    for fast, reference in zip(*grads, strict=True):
        torch.testing.assert_close(fast, reference, rtol=0, atol=1e-4 * reference.abs().max().item())
    assert all(tensor.grad is None for tensor in layer.stored_tensors().values())


@pytest.mark.parametrize("config", [CODECS[5], CODECS[-4], CODECS[-2], CODECS[-1]], ids=config_id)
def test_input_gradient_of_a_large_weight_decoded_in_tiles_matches_the_reference(operators, config):
    # 512 x 3900 float32 is 8 MB: the backward pass decodes it in tiles of 1024 output features (the
    # last one partial; NF4's double-quantized absmax blocks of 256 groups split at tile starts).
    layer = quantized(config, in_features=512, out_features=3900)
    x = torch.randn(3, 5, 512)
    grad = torch.randn(3, 5, 3900)
    grads = []
    for kernel in (dequantize_matmul, native_linear, ctypes_linear):  # ctypes_linear: the C library's backward
        leaf = x.clone().requires_grad_(True)
        kernel(layer, leaf).backward(grad)
        grads.append(leaf.grad)
    for fast in grads[1:]:
        torch.testing.assert_close(fast, grads[0], rtol=0, atol=1e-4 * grads[0].abs().max().item())


@pytest.mark.parametrize("config", [CODECS[3], CODECS[5], CODECS[-4], CODECS[-2]], ids=config_id)
def test_many_rows_in_l2_sized_tiles_compute_each_row_as_alone(operators, config):
    # 80 inputs: about 2,700 rows of x fill a 1 MiB tile, so 6,002 rows run as tiles with a merged tail.
    layer = quantized(config)
    weight = native_weight(layer)
    x = torch.randn(6002, 80)
    with torch.no_grad():
        out = native_matmul(weight, x)  # the fused kernel, whatever product was measured faster here
        torch.testing.assert_close(out + layer.bias, dequantize_matmul(layer, x), rtol=0, atol=1e-4 * out.abs().max())
        for first in (0, 2700, 4096, 5936):  # 64 rows alone take the same kernel path as inside a tile
            assert torch.equal(out[first : first + 64], native_matmul(weight, x[first : first + 64]))


@pytest.mark.parametrize("config", [CODECS[3], CODECS[-4], CODECS[-2]], ids=config_id)
@pytest.mark.parametrize("out_features", [24, 13100])  # 80 x 13100 floats: 4.2 MB, decoded in tiles
@pytest.mark.parametrize("chosen_by", ["QUANTLAB_KERNELS=decoded", "a measurement on this CPU"])
def test_a_product_chosen_decoded_runs_the_weight_decoded_and_torchs_gemm(
    operators, library, config, out_features, chosen_by, monkeypatch
):
    layer = quantized(config, out_features=out_features)
    weight = native_weight(layer).struct
    rows = 16  # the first row count of its bucket: one row fewer is in the bucket below
    if chosen_by == "QUANTLAB_KERNELS=decoded":
        monkeypatch.setenv("QUANTLAB_KERNELS", "decoded")
        tune.reset()
        native.library()
        rows = 2  # decoded from two rows on, one row fused
    else:
        shape_class = library.ql_shape_class(out_features, 80)
        status = library.ql_set_product(library.ql_isa(), weight.kind, weight.bits, shape_class,
                                        library.ql_row_bucket(rows), native.PRODUCT_DECODED)  # fmt: skip
        assert status == 0
    try:
        assert library.ql_product(native_weight(layer).pointer, rows) == native.PRODUCT_DECODED
        assert library.ql_product(native_weight(layer).pointer, rows - 1) == native.PRODUCT_FUSED
        _check_dequantize_first(layer, rows, out_features)
    finally:
        monkeypatch.undo()
        tune.reset()


def _check_dequantize_first(layer, rows: int, out_features: int) -> None:
    x = torch.randn(rows, 80)
    with torch.no_grad():
        expected = x @ native_dequantize(native_weight(layer)).T + layer.bias
        if out_features * 80 * 4 <= 4 << 20:
            assert torch.equal(native_linear(layer, x), expected)  # one GEMM: torch's sums exactly
        for kernel in (native_linear, lambda layer, x: ctypes_linear(layer, x) + layer.bias):
            torch.testing.assert_close(kernel(layer, x), expected, rtol=0, atol=1e-5 * expected.abs().max().item())
        below = x[: rows - 1]  # one row fewer: the fused kernel, bit for bit
        assert torch.equal(native_linear(layer, below), native_matmul(native_weight(layer), below) + layer.bias)


def test_without_a_cxx_compiler_warns_once_and_keeps_the_ctypes_path(operators, monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(extension, "cxx_compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert extension.load.__wrapped__() is None
    monkeypatch.setenv("QUANTLAB_TORCH_OPS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert extension.load.__wrapped__() is None  # switched off: no build, no warning


def _quantized_llama(config):
    model = tiny_llama()
    quantlab.quantize(model, config)
    return model


@pytest.mark.parametrize(
    "config", [CustomBitsConfig(bits=3, group_size=32), NF4Config(blocksize=32), Int8SymmetricConfig()], ids=config_id
)
def test_compiled_forward_has_no_graph_break(operators, config):
    model = _quantized_llama(config)
    ids = torch.arange(3, 15).view(1, 12)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(lambda ids: model(input_ids=ids, use_cache=False).logits)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    targets = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
    assert "quantlab.linear.default" in targets


def test_compiled_model_generates_the_eager_tokens(operators):
    model = _quantized_llama(CustomBitsConfig(bits=4, group_size=32))

    def forward(ids):
        return model(input_ids=ids, use_cache=False).logits

    def greedy(step, ids, tokens: int = 6):
        for _ in range(tokens):
            ids = torch.cat([ids, step(ids)[:, -1:].argmax(-1)], dim=1)
        return ids

    torch._dynamo.reset()
    prompt = torch.arange(3, 15).view(1, 12)
    with torch.no_grad():
        eager = greedy(forward, prompt)
        compiled = greedy(torch.compile(forward, fullgraph=True, dynamic=True), prompt)
    assert torch.equal(compiled, eager)


def test_compiled_training_step_matches_eager_gradients(operators):
    """QLoRA's case: the gradient flows through a frozen quantized layer to what feeds it."""
    layer = quantized(NF4Config(blocksize=32), 64, 48)
    feed = torch.nn.Linear(16, 64)

    def loss(x):
        return layer(feed(x)).square().mean()

    x = torch.randn(4, 16)
    gradients = []
    torch._dynamo.reset()
    for step in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        feed.zero_grad()
        step(x).backward()
        gradients.append(feed.weight.grad.clone())
    torch.testing.assert_close(gradients[1], gradients[0], rtol=1e-5, atol=1e-6)


BAD_ARGUMENTS = {  # what is wrong: (index into the weight arguments, value)
    "bits": (0, lambda d: d.replace("bits=4", "bits=0")),
    "absmax_codes too short": (4, lambda t: t[:-1]),
    "absmax_scale empty": (5, lambda t: t[:0]),
    "float codes": (1, lambda t: t.float()),
    "features": (0, lambda d: d.replace("in_features=80", "in_features=81")),
    "unknown codec": (0, lambda d: d.replace("nf4", "fp4")),
    "unknown key": (0, lambda d: d + " scale=2"),
    "not a number": (0, lambda d: d.replace("group_size=32", "group_size=3x")),
    "no group size": (0, lambda d: d.replace(" group_size=32", "")),
}


@pytest.mark.parametrize("wrong", list(BAD_ARGUMENTS))
def test_inconsistent_arguments_are_refused_not_read_out_of_bounds(operators, wrong):
    arguments = list(operators.weight_arguments(quantized(NF4Config(blocksize=32))))
    index, value = BAD_ARGUMENTS[wrong]
    arguments[index] = value(arguments[index])
    with pytest.raises(RuntimeError, match="quantlab"):
        operators.linear_op(torch.randn(2, 80), None, *arguments)
