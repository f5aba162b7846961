"""onnxruntime's own dynamic int8 quantization of a float export, the baseline quantlab compares to.

`quantize_dynamic` re-quantizes the float weights of MatMul (and Gather) nodes to int8 per
output channel and quantizes activations to uint8 on the fly at run time (DynamicQuantizeLinear
+ MatMulInteger), so its results differ from any quantlab method by both errors.

Weights use 7 bits of the int8 range (`reduce_range=True`, onnxruntime's advice for x86 CPUs
without VNNI): there MatMulInteger multiplies uint8 by int8 with `vpmaddubsw`, whose int16 pair
sums saturate at full range. Measured on an AVX2 CPU (AMD EPYC), tiny Llama logits against
PyTorch's: cosine 0.9878 at full range, 0.9997 reduced. The file runs wherever it is taken, so
it is written the way that is correct on every CPU, not tuned to the exporting one.
"""

from pathlib import Path

from onnxruntime.quantization import QuantType, quantize_dynamic

from quantlab.export.onnx.saving import EXTERNAL_DATA_THRESHOLD, stored_bytes


def quantize_dynamic_int8(float_model: Path, output: Path) -> None:
    size = stored_bytes(float_model)
    quantize_dynamic(
        float_model,
        output,
        weight_type=QuantType.QInt8,
        per_channel=True,
        reduce_range=True,
        use_external_data_format=size > EXTERNAL_DATA_THRESHOLD,
    )
