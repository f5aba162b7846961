"""The native CPU kernels against the reference kernel, on every format, odd shape and dtype."""

import threading

import pytest
import torch

import quantlab
from quantlab import CustomBitsConfig, Int8SymmetricConfig, IQ4NLConfig, LutConfig, NF4Config
from quantlab.kernels import select_kernel
from quantlab.kernels.cpu.linear import native_dequantize, native_linear
from quantlab.kernels.cpu.weights import native_weight, supported
from quantlab.kernels.reference import dequantize_matmul

CONFIGS = [
    Int8SymmetricConfig(),
    Int8SymmetricConfig(group_size=64, scale_dtype="bfloat16"),
    NF4Config(),
    NF4Config(blocksize=128, double_quant=False),
    NF4Config(blocksize=16),
    CustomBitsConfig(bits=4, group_size=64),
    CustomBitsConfig(bits=4, group_size=32, symmetric=True, scale_dtype="float32"),
    CustomBitsConfig(bits=4, group_size=None),
    CustomBitsConfig(bits=3, group_size=64),
    CustomBitsConfig(bits=3, group_size=128, symmetric=True, scale_dtype="bfloat16"),
    CustomBitsConfig(bits=2, group_size=32),
    CustomBitsConfig(bits=5, group_size=None, scale_dtype="float32"),
    CustomBitsConfig(bits=6, group_size=64, symmetric=True),
    CustomBitsConfig(bits=7, group_size=256),
    CustomBitsConfig(bits=8, group_size=64),
    CustomBitsConfig(bits=8, group_size=None, symmetric=True),
    IQ4NLConfig(),
    IQ4NLConfig(group_size=64),
    LutConfig(bits=4, group_size=64),
    LutConfig(bits=3, group_size=32, scale_dtype="bfloat16"),
    LutConfig(bits=2, group_size=None, scale_dtype="float32"),
]
# (in_features, out_features): odd output counts, inputs that no group size divides.
SHAPES = [(256, 64), (200, 37), (577, 33)]
# Rows: one-row kernels (1, 3); AVX2's 4-feature blocks of 3 rows, the last block of 1 or 2 (16, 17);
# its panels of 6 rows, the last of 2, 3 or 4 (50, 45, 128); AVX-512's panels of 32 features from 32
# rows, 8 rows a step, the last of 5 or 2 (45, 50), none left (32, 128).
ROWS = [1, 3, 16, 17, 32, 45, 50, 128]
# Relative to the largest output: fp32 sums in another order; bf16/fp16 round the weights too.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def config_id(config) -> str:
    return f"{config.method}-" + "-".join(
        f"{k}={v}" for k, v in vars(config).items() if k not in ("quant_method", "modules_to_not_convert")
    )


def quantized(config, in_features: int, out_features: int, bias: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    return quantlab.get_method(config.method).module_class.from_linear(linear, config)


def assert_matches(fast: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    assert fast.dtype == reference.dtype and fast.shape == reference.shape
    scale = reference.float().abs().max().item() + 1e-12
    torch.testing.assert_close(fast.float(), reference.float(), rtol=0, atol=TOLERANCE[dtype] * scale)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_dequantize_is_bit_identical(config, isa):
    for in_features, out_features in SHAPES:
        layer = quantized(config, in_features, out_features)
        assert torch.equal(native_dequantize(native_weight(layer)), layer.dequantize_weight(torch.float32))


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_matmul_matches_reference(config, isa):
    for in_features, out_features in SHAPES:
        layer = quantized(config, in_features, out_features)
        for dtype in TOLERANCE:
            for rows in ROWS:
                x = torch.randn(rows, in_features).to(dtype)
                with torch.no_grad():
                    assert_matches(native_linear(layer, x), dequantize_matmul(layer, x), dtype)


@pytest.mark.parametrize("config", CONFIGS[:6], ids=config_id)
def test_gradients_match_reference(config):
    layer = quantized(config, 200, 37)
    layer.bias.requires_grad_(True)
    for rows in (1, 16):
        x = torch.randn(2, rows, 200)
        grads = []
        for kernel in (native_linear, dequantize_matmul):
            leaf = x.clone().requires_grad_(True)
            layer.bias.grad = None
            kernel(layer, leaf).square().sum().backward()
            grads.append((leaf.grad, layer.bias.grad.clone()))
        (x_fast, bias_fast), (x_ref, bias_ref) = grads
        assert_matches(x_fast, x_ref, torch.float32)
        assert_matches(bias_fast, bias_ref, torch.float32)


def test_every_builtin_format_has_a_native_cpu_kernel():
    configs = [Int8SymmetricConfig(), NF4Config(), NF4Config(double_quant=False), IQ4NLConfig()]
    configs += [CustomBitsConfig(bits=b, symmetric=s) for b in range(2, 9) for s in (True, False)]
    for config in configs:
        layer = quantized(config, 64, 8)
        assert layer.format == layer.layout.codec
        assert supported(layer.format)
        assert select_kernel(layer.format, "cpu") is native_linear
    assert {quantized(config, 64, 8).format for config in configs} == {"int8", "nf4", "affine", "iq4_nl"}
    assert select_kernel("int8", "meta") is dequantize_matmul
    assert select_kernel("some_plugin_format", "cpu") is dequantize_matmul


def test_module_forward_uses_native_kernel_and_matches(library):
    layer = quantized(CustomBitsConfig(bits=4, group_size=64), 256, 64)
    x = torch.randn(4, 7, 256)
    with torch.no_grad():
        assert_matches(layer(x), dequantize_matmul(layer, x), torch.float32)


def test_empty_and_strided_inputs(library):
    layer = quantized(NF4Config(), 256, 64)
    with torch.no_grad():
        assert native_linear(layer, torch.randn(0, 256)).shape == (0, 64)
        wide = torch.randn(5, 512)
        strided = wide[:, ::2]
        assert_matches(native_linear(layer, strided), dequantize_matmul(layer, strided), torch.float32)
        columns = wide[:, :256]
        assert_matches(native_linear(layer, columns), dequantize_matmul(layer, columns), torch.float32)


@pytest.mark.parametrize(
    "config", [CustomBitsConfig(bits=4, group_size=64), CustomBitsConfig(bits=3, group_size=64)], ids=config_id
)
def test_many_rows_read_from_a_wider_tensor_equal_the_contiguous_rows(config, isa):
    """From 8 rows AVX2 reads x in place with its row stride: a column slice gives the contiguous result."""
    layer = quantized(config, 256, 40)
    wide = torch.randn(20, 384)
    with torch.no_grad():
        assert torch.equal(native_linear(layer, wide[:, :256]), native_linear(layer, wide[:, :256].contiguous()))


def test_description_follows_changes_to_stored_tensors(library):
    layer = quantized(CustomBitsConfig(bits=4, group_size=64), 256, 64)
    x = torch.randn(2, 256)
    with torch.no_grad():
        native_linear(layer, x)
        layer.weight_scale.mul_(2)  # in place: the version counter moves
        assert_matches(native_linear(layer, x), dequantize_matmul(layer, x), torch.float32)
        other = quantized(CustomBitsConfig(bits=4, group_size=64), 256, 64, seed=1)
        before = native_linear(layer, x)
        layer.load_stored(other.stored_tensors())  # replaced tensors (the bias stays)
        after = native_linear(layer, x)
        assert not torch.allclose(before, after)
        assert_matches(after, dequantize_matmul(layer, x), torch.float32)
        layer.weight_scale = layer.weight_scale.to(torch.bfloat16)  # another dtype
        assert_matches(native_linear(layer, x), dequantize_matmul(layer, x), torch.float32)


def test_half_scales_convert_exactly_including_subnormals(library):
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = halves[torch.isfinite(halves)]
    groups = 32
    rows = finite.numel() // groups
    layer = quantized(CustomBitsConfig(bits=4, group_size=32, symmetric=True), 32 * groups, rows)
    layer.weight_scale = finite[: rows * groups].reshape(rows, groups).clone()
    assert torch.equal(native_dequantize(native_weight(layer)), layer.dequantize_weight(torch.float32))


@pytest.mark.parametrize("rows", [3, 64])
def test_one_and_two_threads_agree(rows, isa):
    """Threads split the features in whole blocks and panels: every output is computed as on one thread."""
    layer = quantized(CustomBitsConfig(bits=4, group_size=64), 512, 1000)
    x = torch.randn(rows, 512)
    previous = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad():
                outputs.append(native_linear(layer, x))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outputs[0], outputs[1])


def test_concurrent_callers_get_their_own_results(library):
    layers = [quantized(CustomBitsConfig(bits=4, group_size=64), 512, 1024, seed=s) for s in range(4)]
    inputs = [torch.randn(2, 512) for _ in layers]
    with torch.no_grad():
        expected = [native_linear(layer, x) for layer, x in zip(layers, inputs, strict=True)]
    failures = []

    def call(index: int) -> None:
        with torch.no_grad():
            for _ in range(50):
                if not torch.equal(native_linear(layers[index], inputs[index]), expected[index]):
                    failures.append(index)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(layers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
