"""`quantlab::linear_group`: several quantized layers of one layout on one input in one call, each
output bit for bit what `quantlab::linear` gives for its layer alone."""

import pytest
import torch

import quantlab
from quantlab import CustomBitsConfig, Int8SymmetricConfig, NF4Config
from quantlab.kernels.cpu import native, ops, tune
from quantlab.kernels.cpu.linear import ctypes_linear
from quantlab.kernels.cpu.weights import native_weight

# 320 inputs: not a multiple of the group size (the last group is padded); 130 and 66 outputs: not
# whole blocks of 4 features. Every layout has work enough for the kernels to use two threads.
IN_FEATURES, OUT_FEATURES = 320, (384, 130, 66)
FORMATS = {
    "4bit-g64": CustomBitsConfig(bits=4, group_size=64),
    "int8": Int8SymmetricConfig(),
    "nf4-dq": NF4Config(blocksize=64, double_quant=True),
    "3bit-g32": CustomBitsConfig(bits=3, group_size=32),
}


def projections(config, bias: bool = False) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    method = quantlab.get_method(config.method).module_class
    layers = [method.from_linear(torch.nn.Linear(IN_FEATURES, n, bias=bias), config) for n in OUT_FEATURES]
    for layer in layers:
        if layer.bias is not None:
            layer.bias.requires_grad_(False)
    return layers


@pytest.fixture(scope="module")
def operators():
    if not ops.available():
        pytest.skip("quantlab's torch operators could not be built here (no C/C++ compiler?)")
    return ops


def separately(x: torch.Tensor, layers: list[torch.nn.Module]) -> torch.Tensor:
    return torch.cat([ops.linear_op(x, *ops.linear_arguments(layer)) for layer in layers], dim=-1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("name", list(FORMATS))
def test_each_output_is_bit_identical_to_its_layer_alone(operators, name, rows, threads):
    layers = projections(FORMATS[name])
    x = torch.randn(rows, IN_FEATURES)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            grouped = operators.linear_group_op(x, *operators.group_arguments(layers))
            expected = separately(x, layers)
    finally:
        torch.set_num_threads(before)
    assert grouped.shape == (rows, sum(OUT_FEATURES))
    assert torch.equal(grouped, expected)


def test_biases_and_a_bfloat16_input_as_linear_adds_them(operators):
    layers = projections(FORMATS["4bit-g64"], bias=True)
    layers[1].bias = None  # one layer without a bias
    x = torch.randn(2, 5, IN_FEATURES).to(torch.bfloat16)
    with torch.no_grad():
        grouped = operators.linear_group_op(x, *operators.group_arguments(layers))
        assert grouped.dtype == torch.bfloat16 and grouped.shape == (2, 5, sum(OUT_FEATURES))
        assert torch.equal(grouped, separately(x, layers))


@pytest.mark.parametrize("name", ["4bit-g64", "nf4-dq"])
def test_opcheck(operators, name):
    layers = projections(FORMATS[name], bias=True)
    arguments = operators.group_arguments(layers)
    for x in (torch.randn(3, IN_FEATURES), torch.randn(2, 1, IN_FEATURES).to(torch.bfloat16)):
        torch.library.opcheck(operators.linear_group_op, (x, *arguments))
        torch.library.opcheck(operators.linear_group_op, (x, [None] * len(layers), *arguments[1:]))


def test_gradients_are_refused_not_silently_dropped(operators):
    layers = projections(FORMATS["int8"])
    x = torch.randn(2, IN_FEATURES, requires_grad=True)
    with pytest.raises(RuntimeError, match="linear_group has no gradient"):
        operators.linear_group_op(x, *operators.group_arguments(layers))


def _gemm_group(layers: list[torch.nn.Module], x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """`ql_gemm_group` called through ctypes on the layers' C descriptions: (status, output)."""
    structs = (native.QuantlabCpuWeight * len(layers))(*(native_weight(layer).struct for layer in layers))
    out = torch.zeros(x.shape[0], sum(layer.out_features for layer in layers))
    status = native.library().ql_gemm_group(
        structs, len(layers), x.data_ptr(), x.shape[0], x.stride(0), out.data_ptr(), out.stride(0), 2, 0
    )
    return status, out


def test_the_c_entry_point_refuses_weights_of_different_layouts(library):
    x = torch.randn(3, IN_FEATURES)
    same = projections(FORMATS["4bit-g64"])
    status, out = _gemm_group(same, x)
    assert status == 0 and torch.equal(out, torch.cat([ctypes_linear(layer, x) for layer in same], dim=-1))
    for other in ("3bit-g32", "nf4-dq"):  # each weight valid alone, not the layout of the first
        status, _ = _gemm_group([same[0], projections(FORMATS[other])[1]], x)
        assert status == 1  # QL_BAD_FORMAT


BF16_ROWS = 128  # the rows from which bfloat16 activations run in torch's bf16 GEMM (torch_ops.cpp, kBf16Rows)
needs_bf16 = pytest.mark.skipif(
    "avx512_bf16" not in tune.cpu_flags(), reason="this CPU has no AVX512-BF16: bf16 activations run in float32"
)


@needs_bf16
@pytest.mark.parametrize("name", ["4bit-g64", "nf4-dq", "int8"])
def test_bfloat16_activations_at_many_rows_run_in_bf16_on_the_decoded_weight(operators, name):
    """From 128 rows a bf16 input is multiplied in torch's bf16 GEMM by the decoded weight rounded to bf16
    (as a bf16 model computes), by `linear` and by `linear_group` alike; below, in float32 as before."""
    layers = projections(FORMATS[name], bias=True)
    weights = [layer.dequantize_weight() for layer in layers]
    for rows in (BF16_ROWS, 3 * BF16_ROWS):
        x = torch.randn(rows, IN_FEATURES).to(torch.bfloat16)
        expected = torch.cat(
            [x @ w.bfloat16().T + layer.bias.bfloat16() for w, layer in zip(weights, layers, strict=True)], dim=-1
        )
        with torch.no_grad():
            assert torch.equal(operators.linear_group_op(x, *operators.group_arguments(layers)), expected)
            assert torch.equal(separately(x, layers), expected)
    layers = projections(FORMATS[name])  # no biases: the float32 path adds them after its cast to bf16
    x = torch.randn(BF16_ROWS - 1, IN_FEATURES).to(torch.bfloat16)
    with torch.no_grad():
        in_float32 = separately(x.float(), layers).to(torch.bfloat16)
        assert torch.equal(separately(x, layers), in_float32)
