"""The ctypes kernels as Python operators (`quantlab_ctypes::linear`, `::dequantize`), what quantized layers
call under torch.compile without the C++ extension: opcheck, and the eager ctypes path's exact results."""

import pytest
import torch

import quantlab
from quantlab import CustomBitsConfig, Int8SymmetricConfig, IQ4NLConfig, LutConfig, NF4Config
from quantlab.kernels.cpu import ops
from quantlab.kernels.cpu.linear import ctypes_linear, native_dequantize
from quantlab.kernels.cpu.weights import native_weight

CODECS = {
    "2bit": CustomBitsConfig(bits=2, group_size=32),
    "3bit-symmetric": CustomBitsConfig(bits=3, group_size=32, symmetric=True),
    "4bit": CustomBitsConfig(bits=4, group_size=32),
    "int8-bf16-scale": Int8SymmetricConfig(group_size=32, scale_dtype="bfloat16"),
    "nf4-double-quant": NF4Config(blocksize=32),
    "nf4-plain": NF4Config(blocksize=32, double_quant=False),
    "iq4_nl": IQ4NLConfig(),
    "lut3": LutConfig(bits=3, group_size=32),
}


@pytest.fixture
def layer(library, request):
    torch.manual_seed(0)
    config = CODECS[request.param]
    return quantlab.get_method(config.method).module_class.from_linear(torch.nn.Linear(80, 24), config)


@pytest.mark.parametrize("layer", list(CODECS), indirect=True)
def test_opcheck(layer):
    weight = ops.weight_arguments(layer)
    for x in (torch.randn(3, 80, requires_grad=True), torch.randn(2, 3, 80).to(torch.bfloat16)):
        torch.library.opcheck(torch.ops.quantlab_ctypes.linear.default, (x, *weight))
    torch.library.opcheck(torch.ops.quantlab_ctypes.dequantize.default, weight)


@pytest.mark.parametrize("layer", list(CODECS), indirect=True)
def test_the_operators_compute_what_the_cached_ctypes_path_computes(layer):
    weight = ops.weight_arguments(layer)
    x = torch.randn(5, 80)
    assert torch.equal(torch.ops.quantlab_ctypes.linear(x, *weight), ctypes_linear(layer, x))
    assert torch.equal(torch.ops.quantlab_ctypes.dequantize(*weight), native_dequantize(native_weight(layer)))
