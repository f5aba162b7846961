"""`quantlab::linear_group(..., activation_bits=8)`: 4-bit affine layers on activations rounded to int8 per
block of 64 inputs (avx512_vnni.c). The kernel must equal, up to float summation order, the float product
of the *rounded* activations with the dequantized weight; formats it does not take compute in float."""

import pytest
import torch

import quantlab
from quantlab import CustomBitsConfig, NF4Config
from quantlab.kernels.cpu import native, ops


@pytest.fixture(scope="module")
def operators():
    if not ops.available():
        pytest.skip("quantlab's torch operators could not be built here (no C/C++ compiler?)")
    if not native.int8_activations_supported():
        pytest.skip("the int8-activation kernel needs AVX512-VNNI")
    return ops


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


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_int8_activations_equal_the_rounded_activations_times_the_weight(operators, symmetric, group_size, rows):
    config = CustomBitsConfig(bits=4, group_size=group_size, symmetric=symmetric)
    layers = [layer(config, 576, n) for n in (192, 130)]  # 130: not whole blocks of 4 features
    x = torch.randn(rows, 576) * torch.linspace(0.1, 3.0, 576)
    weight = torch.cat([module.dequantize_weight() for module in layers]).double()
    expected = rounded_activations(x) @ weight.T
    got = run(layers, x, 8)
    scale = expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= 2e-6 * scale
    float_result = run(layers, x, 0)  # the float kernel: measurably different, so the int8 path ran
    assert (float_result.double() - expected).abs().max().item() > 1e-4 * scale
    relative = (got - float_result).norm() / float_result.norm()
    assert 1e-4 < relative.item() < 2e-2


def test_formats_the_int8_kernel_does_not_take_compute_in_float(operators):
    for config in (NF4Config(blocksize=64), CustomBitsConfig(bits=4, group_size=32), CustomBitsConfig(bits=3)):
        layers = [layer(config, 256, 64)]
        x = torch.randn(2, 256)
        assert torch.equal(run(layers, x, 8), run(layers, x, 0))


def test_activation_bits_other_than_0_or_8_are_refused(operators):
    layers = [layer(CustomBitsConfig(bits=4, group_size=64), 128, 16)]
    with pytest.raises(RuntimeError, match="activation_bits is 0"):
        run(layers, torch.randn(1, 128), 4)


def test_opcheck_with_int8_activations(operators):
    layers = [layer(CustomBitsConfig(bits=4, group_size=64), 128, 16, bias=True)]
    for module in layers:
        module.bias.requires_grad_(False)
    torch.library.opcheck(ops.linear_group_op, (torch.randn(3, 128), *ops.group_arguments(layers), 8))
