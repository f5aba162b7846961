"""ONNX export of float and quantlab-quantized transformers models, run by onnxruntime.

`to_onnx(model, path)` writes one ONNX file whose quantized layers are onnxruntime low-bit
operators carrying quantlab's own codes and scales; `OnnxCausalLM` generates text with it.
Needs the `onnx` extra (onnx, onnxruntime, onnxscript, onnx-ir).
"""

from quantlab.export.errors import ExportError
from quantlab.export.exporter import OnnxExport, to_onnx
from quantlab.export.lowering import LayerLowering, register_onnx_lowering
from quantlab.export.runtime import OnnxCausalLM

__all__ = ["ExportError", "LayerLowering", "OnnxCausalLM", "OnnxExport", "register_onnx_lowering", "to_onnx"]
