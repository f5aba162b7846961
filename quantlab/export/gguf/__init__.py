"""GGUF export: a Llama-family (Mistral, Granite), Qwen2/3, Phi-3, Gemma 2/3, OLMo 2, GPT-2, GPT-NeoX, Falcon or
mixture-of-experts causal LM (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek V3) as one file llama.cpp runs,
quantlab's codes kept (the experts' too; fused projections' rows reordered whole, as llama.cpp reads them).

`to_gguf(model, path, tokenizer=...)` writes every quantized layer whose codes a GGUF block type
holds exactly (symmetric 4-bit → Q4_0, int8 / symmetric 8-bit → Q8_0, 4-bit with zero points →
Q4_1 when float16 holds `-zero * scale`) from those codes, and re-quantizes the rest, reporting
each tensor. Needs the `gguf` package (the `models` extra).
"""

from quantlab.export.gguf.errors import GGUFExportError
from quantlab.export.gguf.exporter import GGUFExport, to_gguf
from quantlab.export.gguf.tensors import FALLBACK_TYPES, GGUFTensor

__all__ = ["FALLBACK_TYPES", "GGUFExport", "GGUFExportError", "GGUFTensor", "to_gguf"]
