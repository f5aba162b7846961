"""`quantlab::linear_group(..., activation_bits=8)`: 4-bit affine and int8 layers on activations rounded to
int8 per block of 64 inputs (int8_activations.c; kernels for AVX2 and AVX512-VNNI, each tested where the CPU
has it; the many-row kernels in test_int8_activation_rows.py). The kernel must equal, up to float summation
order, the float product of the *rounded* activations with the dequantized weight; formats it does not take
compute in float."""

import pytest
import torch

import quantlab
from quantlab import CustomBitsConfig, Int8SymmetricConfig, NF4Config
from quantlab.kernels.cpu import ops
from quantlab.nn.quantized_embedding import QuantizedOutputHead


def layer(config, in_features: int, out_features: int, bias: bool = False) -> torch.nn.Module:
    torch.manual_seed(in_features + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    return quantlab.get_method(config.method).module_class.from_linear(linear, config)


def rounded_activations(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """x as the kernel rounds it: per block of 64 inputs, round(x * (127 / max|x|)) in float32 times max|x| / 127."""
    rows, k = x.shape
    padded = torch.nn.functional.pad(x, (0, -k % block)).view(rows, -1, block)
    amax = padded.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(padded * inverse)
    return (q.double() * (amax / 127.0).double()).view(rows, -1)[:, :k]


def run(layers, x, activation_bits: int) -> torch.Tensor:
    with torch.no_grad():
        return ops.linear_group_op(x, *ops.group_arguments(layers), activation_bits)


def head(in_features: int, out_features: int, embedding_group_size: int | None = 64) -> torch.nn.Module:
    """An untied output head as `embedding_bits=8` stores it: int8 codes, float16 scales."""
    torch.manual_seed(in_features + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    config = CustomBitsConfig(bits=4, embedding_bits=8, embedding_group_size=embedding_group_size)
    return QuantizedOutputHead.from_linear(linear, config)


def assert_int8_kernel_ran(layers, x) -> None:
    """The int8 kernel's output is the rounded activations times the dequantized weight, and measurably
    not the float kernel's."""
    weight = torch.cat([module.dequantize_weight() for module in layers]).double()
    expected = rounded_activations(x) @ weight.T
    got = run(layers, x, 8)
    scale = expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= 2e-6 * scale
    float_result = run(layers, x, 0)  # the float kernel: measurably different, so the int8 path ran
    assert (float_result.double() - expected).abs().max().item() > 1e-4 * scale
    relative = (got - float_result).norm() / float_result.norm()
    assert 1e-4 < relative.item() < 2e-2


def activations(rows: int, k: int = 576) -> torch.Tensor:
    return torch.randn(rows, k) * torch.linspace(0.1, 3.0, k)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("rows", [1, 3, 7])  # 1, 3: the one-row kernels; 7: the many-row ones (from 4)
# groups a row at 64 / 128: 9 / 5 (scales in one register), 24 / 12 (two), 33 / 17 (through memory above 32)
@pytest.mark.parametrize("in_features", [576, 1536, 2112])
def test_int8_activations_equal_the_rounded_activations_times_the_weight(
    operators, symmetric, group_size, rows, in_features
):
    config = CustomBitsConfig(bits=4, group_size=group_size, symmetric=symmetric)
    layers = [layer(config, in_features, n) for n in (192, 130)]  # 130: not whole blocks of 4 features
    assert_int8_kernel_ran(layers, activations(rows, in_features))


@pytest.mark.parametrize("group_size", [None, 64, 128])  # None: one group per row, 576 = 9 blocks of 64
@pytest.mark.parametrize("rows", [1, 3, 7])  # 1, 3: the one-row kernels; 7: the many-row ones (from 4)
def test_int8_weights_on_int8_activations_equal_the_rounded_activations_times_the_weight(operators, group_size, rows):
    layers = [layer(Int8SymmetricConfig(group_size=group_size), 576, n) for n in (192, 130)]
    assert_int8_kernel_ran(layers, activations(rows))


@pytest.mark.parametrize("rows", [1, 3, 7])  # 1, 3: the one-row kernels; 7: the many-row ones (from 4)
def test_an_int8_output_head_on_int8_activations_equals_the_rounded_activations_times_the_table(operators, rows):
    assert_int8_kernel_ran([head(576, 130)], activations(rows))  # float16 scales, groups of 64


def test_the_int8_kernel_takes_the_extreme_codes_and_activations(operators):
    """Codes -127..127 (and the -128 a stored table may hold) against x at +-max|x|: the offset of the
    signed codes to unsigned ones and its share are exact."""
    module = layer(Int8SymmetricConfig(group_size=64), 128, 8)
    codes = torch.arange(-128, 128, dtype=torch.int8).repeat(4).view(8, 2, 64)
    module.weight.copy_(codes)
    x = torch.where(torch.arange(128) % 3 == 0, 1.0, -1.0).repeat(2, 1)
    x[1] *= torch.linspace(0.5, 2.0, 128)
    assert_int8_kernel_ran([module], x)


def test_formats_the_int8_kernel_does_not_take_compute_in_float(operators):
    configs = (
        NF4Config(blocksize=64),
        CustomBitsConfig(bits=4, group_size=32),
        CustomBitsConfig(bits=3),
        Int8SymmetricConfig(group_size=32),
        Int8SymmetricConfig(),  # one group per row of 96 inputs: not whole blocks of 64
    )
    for module in [*(layer(config, 96, 64) for config in configs), head(96, 64, embedding_group_size=32)]:
        x = torch.randn(2, 96)
        assert torch.equal(run([module], x, 8), run([module], x, 0)), module


def test_activation_bits_other_than_0_or_8_are_refused(operators):
    layers = [layer(CustomBitsConfig(bits=4, group_size=64), 128, 16)]
    with pytest.raises(RuntimeError, match="activation_bits is 0"):
        run(layers, torch.randn(1, 128), 4)


def test_opcheck_with_int8_activations(operators):
    layers = [layer(CustomBitsConfig(bits=4, group_size=64), 128, 16, bias=True)]
    for module in layers:
        module.bias.requires_grad_(False)
    torch.library.opcheck(ops.linear_group_op, (torch.randn(3, 128), *ops.group_arguments(layers), 8))


def test_opcheck_with_int8_weights_and_activations(operators):
    layers = [layer(Int8SymmetricConfig(), 128, 16, bias=True)]
    for module in layers:
        module.bias.requires_grad_(False)
    torch.library.opcheck(ops.linear_group_op, (torch.randn(3, 128), *ops.group_arguments(layers), 8))
