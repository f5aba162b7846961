"""ONNX lowerings of the built-in storage codecs: which onnxruntime operator computes each layer.

The operator is chosen from the layer's storage layout (codec, bits, zero point, group size),
whatever the layer's class: every method storing a built-in codec exports the same way.

| layout | operator |
| --- | --- |
| int8 (any group size) | `MatMulNBits` 8-bit, codes + 128 with the default zero point 128 |
| affine 2/4-bit, symmetric or asymmetric | `MatMulNBits` (float zero points when asymmetric) |
| affine 8-bit symmetric | `MatMulNBits` 8-bit |
| affine 3/5/6/7-bit (and 1-bit), 8-bit asymmetric | fallback: unpack + `(q - zero) * scale` + MatMul |
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

from quantlab.export import layouts
from quantlab.export.lowering import LayerLowering, register_codec_lowering
from quantlab.nn import QuantizedLinear


@register_codec_lowering("int8")
def lower_int8(ctx: LayerLowering, module: QuantizedLinear):
    layout = module.layout
    codes, params = module.codes_and_params()  # unsigned: the signed byte + 128, zero point 128
    weight = layouts.matmul_nbits_weight(codes, params.scale, None, layout.bits, module.in_features)
    return ctx.matmul_nbits(weight, module)


@register_codec_lowering("affine")
def lower_affine(ctx: LayerLowering, module: QuantizedLinear):
    layout = module.layout
    if layouts.supports_matmul_nbits(layout.bits, layout.has_zero):
        codes, params = module.codes_and_params()
        weight = layouts.matmul_nbits_weight(codes, params.scale, params.zero, layout.bits, module.in_features)
        return ctx.matmul_nbits(weight, module)
    # The fallback keeps the packed codes and the scales (and zero points) in their stored dtypes.
    stored = module.stored_tensors()
    values = ctx.to_float(ctx.unpacked_codes(stored["weight"], layout.bits, layout.group_length))
    if layout.has_zero:
        zero_point = ctx.grouped_param("zero", stored["weight_zero"])
    else:
        zero_point = ctx.constant("zero_point", [layout.constant_zero], ctx.activation_dtype())
    values = ctx.op("Mul", [ctx.op("Sub", [values, zero_point]), ctx.grouped_param("scale", stored["weight_scale"])])
    return ctx.dequantize_matmul(ctx.ungroup(values, module.out_features, module.in_features), module)


@register_codec_lowering("nf4")
def lower_nf4(ctx: LayerLowering, module: QuantizedLinear):
    layout = module.layout
    absmax = layout.params(module.stored_tensors()).scale  # float32, expanded under double quantization
    if layouts.bnb4_block_size(module.in_features, layout.group_length) is not None:
        weight = layouts.matmul_bnb4_weight(layout.codes(module.weight), absmax, module.in_features)
        return ctx.matmul_bnb4(weight, module)
    codes = ctx.unpacked_codes(module.weight, layout.bits, layout.group_length)
    levels = ctx.initializer("nf4_levels", layout.levels().to(ctx.activation_dtype()))
    values = ctx.op("Mul", [ctx.op("Gather", [levels, codes]), ctx.grouped_param("absmax", absmax)])
    return ctx.dequantize_matmul(ctx.ungroup(values, module.out_features, module.in_features), module)
