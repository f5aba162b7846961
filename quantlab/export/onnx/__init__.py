"""The ONNX export: `to_onnx` traces a model with a placeholder node per quantized layer (`placeholder`), then
lowers each placeholder to onnxruntime operators fed with the layer's own codes and scales (`lower_graph`, by the
lowering each codec names: `lowering`, `codec_lowerings`, `expert_lowering`, `layouts`); `OnnxCausalLM`
(`runtime`) generates text with the file. Needs the `onnx` extra (onnx, onnxruntime, onnxscript, onnx-ir)."""
