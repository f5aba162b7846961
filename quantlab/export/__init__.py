"""Exports of float and quantlab-quantized transformers models to other runtimes.

ONNX: `to_onnx(model, path)` writes one ONNX file whose quantized layers are onnxruntime low-bit
operators carrying quantlab's own codes and scales; `OnnxCausalLM` generates text with it. Needs
the `onnx` extra (onnx, onnxruntime, onnxscript, onnx-ir).

GGUF (`quantlab.export.gguf`): one file for llama.cpp; needs only the `gguf` package, so the
names below load the ONNX machinery when first used, not when the package is imported.

compressed-tensors (`to_compressed_tensors`, `quantlab.export.compressed_tensors`): a checkpoint
folder transformers and vLLM load with the `compressed-tensors` package; needs no extra to write.
"""

import importlib
from typing import Any

_EXPORTS = {
    "ExportError": "quantlab.export.onnx.errors",
    "LayerLowering": "quantlab.export.onnx.lowering",
    "OnnxCausalLM": "quantlab.export.onnx.runtime",
    "OnnxExport": "quantlab.export.onnx.exporter",
    "register_onnx_lowering": "quantlab.export.onnx.lowering",
    "to_compressed_tensors": "quantlab.export.compressed_tensors",
    "to_onnx": "quantlab.export.onnx.exporter",
}

__all__ = [
    "ExportError",
    "LayerLowering",
    "OnnxCausalLM",
    "OnnxExport",
    "register_onnx_lowering",
    "to_compressed_tensors",
    "to_onnx",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
