"""ONNX lowerings of the codec grids: which onnxruntime operator computes each layer.

A codec names its lowering (`Codec.onnx_lowering`); the operator is chosen from the layer's
storage layout (bits, zero point, group size, levels), whatever the layer's class: every method
storing a codec exports the same way.

| codec lowering | layout | operator |
| --- | --- | --- |
| integer-grid | int8 (any group size) | `MatMulNBits` 8-bit, codes + 128 with the default zero point 128 |
| integer-grid | 2/4-bit, symmetric or asymmetric | `MatMulNBits` (float zero points when asymmetric) |
| integer-grid | 8-bit symmetric | `MatMulNBits` 8-bit |
| integer-grid | 3/5/6/7-bit (and 1-bit), 8-bit asymmetric | fallback: unpack + `(q - zero) * scale` + MatMul |
| level-table | NF4 levels, a block of 16-256 tiles K and the blocksize | `MatMulBnb4`, absmax expanded to float |
| level-table | otherwise | fallback: table lookup * scale + MatMul |

onnxruntime's CPU MatMulNBits runs 2, 4 and 8 bits with blocks of 16 to 256, and float zero
points at 2 and 4 bits only; quantlab's asymmetric zero is a float, so 8-bit asymmetric takes
the fallback. With float zero points, and at 2 and 8 bits, onnxruntime's kernel dequantizes the
weight on every call unless activations may be int8 (`to_onnx(accuracy_level=4)`), hence
`LayerLowering.zero_point_correction` at 4 bits; the timings are in benchmarks/RESULTS.md.
"""

import torch

from quantlab.export.onnx import layouts
from quantlab.export.onnx.lowering import LayerLowering, lower_dequantized, register_grid_lowering
from quantlab.formats.nf4 import NF4_LEVELS
from quantlab.nn import QuantizedLinear


@register_grid_lowering("integer-grid")
def lower_integer_grid(ctx: LayerLowering, module: QuantizedLinear):
    """`(q - zero) * scale` on integer codes: MatMulNBits where it holds the layout, else the fallback."""
    layout = module.layout
    if layouts.supports_matmul_nbits(layout.bits, layout.has_zero):
        codes, params = module.codes_and_params()  # unsigned (int8: the signed byte + 128, zero point 128)
        weight = layouts.matmul_nbits_weight(codes, params.scale, params.zero, layout.bits, module.in_features)
        return ctx.matmul_nbits(weight, module)
    if not layout.packed:
        return lower_dequantized(ctx, module)
    # The fallback keeps the packed codes and the scales (and zero points) in their stored dtypes.
    stored = module.stored_tensors()
    values = ctx.to_float(ctx.unpacked_codes(stored["weight"], layout.bits, layout.group_length))
    if layout.has_zero:
        zero_point = ctx.grouped_param("zero", stored["weight_zero"])
    else:
        zero_point = ctx.constant("zero_point", [layout.constant_zero], ctx.activation_dtype())
    values = ctx.op("Mul", [ctx.op("Sub", [values, zero_point]), ctx.grouped_param("scale", stored["weight_scale"])])
    return ctx.dequantize_matmul(ctx.ungroup(values, module.out_features, module.in_features), module)


@register_grid_lowering("level-table")
def lower_level_table(ctx: LayerLowering, module: QuantizedLinear):
    """`level[q] * scale` (zero point 0): MatMulBnb4 for the NF4 table where its blocks tile the
    layout, else a Gather of the table."""
    layout = module.bound_layout()  # the layer's own table where the codec learns one
    table = layout.levels()
    scale = layout.params(module.stored_tensors()).scale  # float32, expanded under double quantization
    nf4 = torch.equal(table, torch.tensor(NF4_LEVELS, dtype=table.dtype))
    if nf4 and layouts.bnb4_block_size(module.in_features, layout.group_length) is not None:
        weight = layouts.matmul_bnb4_weight(layout.codes(module.weight), scale, module.in_features)
        return ctx.matmul_bnb4(weight, module)
    codes = ctx.unpacked_codes(module.weight, layout.bits, layout.group_length)
    levels = ctx.initializer(f"{layout.codec}_levels", table.to(ctx.activation_dtype()))
    values = ctx.op("Mul", [ctx.op("Gather", [levels, codes]), ctx.grouped_param("absmax", scale)])
    return ctx.dequantize_matmul(ctx.ungroup(values, module.out_features, module.in_features), module)
