"""onnxruntime layouts hold exactly the weights quantlab stores, and the fallback unpacks every width.

These run no exporter: each layout is dequantized with the operator's documented formula in
torch (or run as a one-node graph) and compared bit for bit with the layer's own dequantization.
"""

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import quantlab
from quantlab.export.onnx import layouts
from quantlab.export.onnx.lowering import LayerLowering
from quantlab.formats import grouping, nf4, packing
from quantlab.methods.custom_bits import CustomBitsLinear
from quantlab.methods.int8 import Int8Linear
from quantlab.methods.nf4 import NF4Linear


def _linear(in_features: int, out_features: int = 24, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=False)


def _matmul_nbits_weight(weight: layouts.NBitsWeight) -> torch.Tensor:
    """MatMulNBits' dequantization: `(q - zero_point) * scale` per block, cut to K."""
    codes = packing.unpack(weight.packed, weight.bits, weight.block_size).float()
    zero = 2.0 ** (weight.bits - 1) if weight.zero_points is None else weight.zero_points.unsqueeze(-1)
    return grouping.ungroup((codes - zero) * weight.scales.unsqueeze(-1), weight.in_features)


def _matmul_bnb4_weight(weight: layouts.Bnb4Weight) -> torch.Tensor:
    """MatMulBnb4's dequantization: high nibble first over the flattened [N, K] weight."""
    codes = torch.stack([weight.packed >> 4, weight.packed & 0x0F], dim=-1).reshape(-1)
    values = nf4.levels()[codes.long()].reshape(-1, weight.block_size) * weight.absmax.unsqueeze(-1)
    return values.reshape(weight.out_features, weight.in_features)


@pytest.mark.parametrize(
    ("in_features", "group_size"), [(96, None), (576, None), (100, None), (96, 32), (1000, 512), (64, 4096)]
)
def test_int8_layout_dequantizes_to_the_same_weight(in_features, group_size) -> None:
    config = quantlab.Int8SymmetricConfig(group_size=group_size)
    layer = Int8Linear.from_linear(_linear(in_features), config)
    codes = (layer.weight.to(torch.int16) + 128).to(torch.uint8)
    weight = layouts.matmul_nbits_weight(codes, layer.weight_scale, None, 8, in_features)
    assert weight.block_size in layouts.ORT_BLOCK_SIZES
    assert torch.equal(_matmul_nbits_weight(weight), layer.dequantize_weight())


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("in_features", "group_size"), [(96, 64), (576, None), (72, 32)])
def test_custom_bits_layout_dequantizes_to_the_same_weight(bits, symmetric, in_features, group_size) -> None:
    if bits == 8 and not symmetric:
        pytest.skip("8-bit float zero points are not a MatMulNBits layout (fallback)")
    config = quantlab.CustomBitsConfig(bits=bits, group_size=group_size, symmetric=symmetric, scale_dtype="float32")
    layer = CustomBitsLinear.from_linear(_linear(in_features), config)
    zero = getattr(layer, "weight_zero", None)
    codes, _ = layer.codes_and_params()
    weight = layouts.matmul_nbits_weight(codes, layer.weight_scale, zero, bits, in_features)
    assert torch.equal(_matmul_nbits_weight(weight), layer.dequantize_weight())


def test_per_channel_block_size_stores_the_fewest_bytes() -> None:
    assert layouts.nbits_block_size(1, 576, 576, 4) == 64  # 9 blocks, no padding
    assert layouts.nbits_block_size(1, 1536, 1536, 8) == 256  # divides 1536
    assert layouts.nbits_block_size(4, 64, 256, 4) == 64  # a supported group is kept
    assert layouts.nbits_block_size(2, 512, 1000, 8) == 256  # tiles the 512-wide groups


@pytest.mark.parametrize(("in_features", "blocksize", "block"), [(128, 64, 64), (96, 64, 32), (64, 512, 64)])
@pytest.mark.parametrize("double_quant", [True, False])
def test_nf4_layout_dequantizes_to_the_same_weight(in_features, blocksize, block, double_quant) -> None:
    layer = NF4Linear.from_linear(
        _linear(in_features), quantlab.NF4Config(blocksize=blocksize, double_quant=double_quant)
    )
    codes, params = layer.codes_and_params()
    weight = layouts.matmul_bnb4_weight(codes, params.scale, in_features)
    assert weight.block_size == block
    assert torch.equal(_matmul_bnb4_weight(weight), layer.dequantize_weight())


def test_nf4_without_a_tiling_block_has_no_layout() -> None:
    assert layouts.bnb4_block_size(72, 64) is None


def test_nf4_layout_is_bitsandbytes_own_packing() -> None:
    functional = pytest.importorskip("bitsandbytes.functional")
    linear = _linear(128, 16)
    packed, state = functional.quantize_4bit(linear.weight.data, blocksize=64, quant_type="nf4")
    layer = NF4Linear.from_linear(linear, quantlab.NF4Config(blocksize=64, double_quant=False))
    codes, params = layer.codes_and_params()
    weight = layouts.matmul_bnb4_weight(codes, params.scale, 128)
    assert torch.equal(weight.packed, packed.reshape(-1))
    assert torch.equal(weight.absmax, state.absmax.float())


@pytest.mark.parametrize("bits", range(1, 8))
def test_fallback_unpacks_every_width_in_onnxruntime(bits) -> None:
    codes = torch.randint(0, 1 << bits, (4, 3, 40), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([1]))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 20})
    ctx = LayerLowering(name="layer", x=x, graph=graph, created={})
    out = ctx.unpacked_codes(packing.pack(codes, bits), bits, 40)
    out.dtype, out.shape = ir.DataType.INT32, ir.Shape([4, 3, 40])
    graph.extend(ctx.tape.nodes)
    graph.outputs.append(out)
    session = ort.InferenceSession(ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString())
    (result,) = session.run(None, {"x": np.zeros(1, np.float32)})
    assert np.array_equal(result, codes.numpy())
