"""ONNX lowerings of the built-in methods: which onnxruntime operator computes each layer.

| layer | operator |
| --- | --- |
| int8 (any group size) | `MatMulNBits` 8-bit, codes + 128 with the default zero point 128 |
| custom_bits 2/4-bit, symmetric or asymmetric | `MatMulNBits` (float zero points when asymmetric) |
| custom_bits 8-bit symmetric | `MatMulNBits` 8-bit |
| custom_bits 3/5/6/7-bit, 8-bit asymmetric | fallback: unpack + `(q - zero) * scale` + MatMul |
| nf4 when a block of 16-256 tiles K and the blocksize | `MatMulBnb4`, absmax expanded to float |
| nf4 otherwise (K with no power-of-two factor >= 16) | fallback: NF4 table lookup * absmax + MatMul |

onnxruntime 1.31's CPU MatMulNBits runs 2, 4 and 8 bits with blocks of 16 to 256, and float
zero points at 2 and 4 bits only (checked on this version); quantlab's asymmetric zero is a
float, so 8-bit asymmetric takes the fallback.

Speed of one 576x1536 layer at one row (decoding), 2 threads, float activations: fp32 MatMul
0.49 ms; MatMulNBits 4-bit 0.34 ms (default zero point), 12 ms with float zero points (hence
`LayerLowering.zero_point_correction`); 2-bit 12 ms and 8-bit 9 ms, because onnxruntime
dequantizes 2- and 8-bit weights on every call unless activations may be int8
(`to_onnx(accuracy_level=4)`: 0.14 and 0.12 ms, no longer equal to PyTorch).
"""

import torch

from quantlab.export import layouts
from quantlab.export.lowering import LayerLowering, register_onnx_lowering
from quantlab.formats import nf4
from quantlab.methods.custom_bits import CustomBitsLinear
from quantlab.methods.int8 import Int8Linear
from quantlab.methods.nf4 import NF4Linear

_INT8_OFFSET = 128


@register_onnx_lowering(Int8Linear)
def lower_int8(ctx: LayerLowering, module: Int8Linear):
    codes = (module.weight.to(torch.int16) + _INT8_OFFSET).to(torch.uint8)
    weight = layouts.matmul_nbits_weight(codes, module.weight_scale, None, 8, module.in_features)
    return ctx.matmul_nbits(weight, module)


@register_onnx_lowering(CustomBitsLinear)
def lower_custom_bits(ctx: LayerLowering, module: CustomBitsLinear):
    bits = module.config.bits
    zero = getattr(module, "weight_zero", None)
    if layouts.supports_matmul_nbits(bits, zero is not None):
        weight = layouts.matmul_nbits_weight(module.codes(), module.weight_scale, zero, bits, module.in_features)
        return ctx.matmul_nbits(weight, module)
    group_size = module.codes().shape[-1]
    values = ctx.to_float(ctx.unpacked_codes(module.weight, bits, group_size))
    if zero is None:
        zero_point = ctx.constant("zero_point", [float(1 << (bits - 1))], ctx.activation_dtype())
    else:
        zero_point = ctx.grouped_param("zero", zero)
    values = ctx.op("Mul", [ctx.op("Sub", [values, zero_point]), ctx.grouped_param("scale", module.weight_scale)])
    return ctx.dequantize_matmul(ctx.ungroup(values, module.out_features, module.in_features), module)


@register_onnx_lowering(NF4Linear)
def lower_nf4(ctx: LayerLowering, module: NF4Linear):
    absmax = module.absmax()
    if layouts.bnb4_block_size(module.in_features, module.config.blocksize) is not None:
        return ctx.matmul_bnb4(layouts.matmul_bnb4_weight(module.codes(), absmax, module.in_features), module)
    codes = ctx.unpacked_codes(module.weight, 4, module.config.blocksize)
    levels = ctx.initializer("nf4_levels", nf4.levels().to(ctx.activation_dtype()))
    values = ctx.op("Mul", [ctx.op("Gather", [levels, codes]), ctx.grouped_param("absmax", absmax)])
    return ctx.dequantize_matmul(ctx.ungroup(values, module.out_features, module.in_features), module)
