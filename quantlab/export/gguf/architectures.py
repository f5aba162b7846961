"""The transformers causal LMs llama.cpp runs that the GGUF export knows: their GGUF architecture,
hyperparameter keys and tensor names, as llama.cpp's own converter (`convert_hf_to_gguf.py`) writes them.

- `llama` (Llama 2/3, SmolLM2, ...): rotary embedding on interleaved pairs in llama.cpp, so the
  rows of the q and k projections are permuted from transformers' half-split layout (`rope_rows`).
- `qwen2`: the same block with q/k/v biases and the half-split (NeoX) rotary layout: no permutation.
"""

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from quantlab.export.gguf.errors import GGUFExportError


@dataclass(frozen=True)
class Architecture:
    """One architecture: `name` is GGUF's `general.architecture`; `model_type` is transformers'."""

    name: str
    model_type: str
    rope_permuted: bool  # q/k rows in llama.cpp's interleaved rotary layout
    writes_vocab_size: bool


ARCHITECTURES = {
    "llama": Architecture("llama", "llama", rope_permuted=True, writes_vocab_size=True),
    "qwen2": Architecture("qwen2", "qwen2", rope_permuted=False, writes_vocab_size=False),
}

# transformers module name → GGUF tensor name (without the `.weight` / `.bias` suffix)
_MODULE_NAMES = [
    (r"model\.embed_tokens", "token_embd"),
    (r"model\.norm", "output_norm"),
    (r"lm_head", "output"),
    (r"model\.layers\.(\d+)\.input_layernorm", r"blk.\1.attn_norm"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj", r"blk.\1.attn_q"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj", r"blk.\1.attn_k"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj", r"blk.\1.attn_v"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj", r"blk.\1.attn_output"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm", r"blk.\1.ffn_norm"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj", r"blk.\1.ffn_gate"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj", r"blk.\1.ffn_up"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj", r"blk.\1.ffn_down"),
]
_COMPILED = [(re.compile(pattern + r"$"), name) for pattern, name in _MODULE_NAMES]


def architecture_of(model: Any) -> Architecture:
    """The architecture of a transformers causal LM; GGUFExportError naming the supported ones otherwise."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for architecture in ARCHITECTURES.values():
        if architecture.model_type == model_type:
            return architecture
    supported = ", ".join(sorted(ARCHITECTURES))
    raise GGUFExportError(
        f"a {model_type or type(model).__name__} model cannot be written as GGUF; supported architectures: "
        f"{supported} (Llama-family and Qwen2 causal LMs)"
    )


def gguf_name(module_name: str) -> str | None:
    """The GGUF name of a module's tensors (`blk.0.attn_q`), or None for a module GGUF has no tensor for."""
    for pattern, name in _COMPILED:
        if pattern.match(module_name):
            return pattern.sub(name, module_name)
    return None


def rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter gives a q or k projection of `heads` heads: within each head,
    the two halves of transformers' rotary layout interleaved (row i of each half becomes rows 2i, 2i+1)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, 2, half).transpose(1, 2).reshape(-1)


def permutation(architecture: Architecture, config: Any, gguf_base: str, rows: int) -> torch.Tensor | None:
    """The rows to gather from a q/k projection (weight or bias) of `architecture`, or None to keep the order."""
    if not architecture.rope_permuted:
        return None
    if gguf_base.endswith(".attn_q"):
        return rope_rows(rows, config.num_attention_heads)
    if gguf_base.endswith(".attn_k"):
        return rope_rows(rows, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return None


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def write_hyperparameters(writer: Any, architecture: Architecture, config: Any) -> dict[str, torch.Tensor]:
    """Add the architecture's hyperparameter keys to `writer`; returns the extra tensors they need
    (Llama 3's `rope_freqs`)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    rope = _rope_parameters(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    if architecture.writes_vocab_size:
        writer.add_vocab_size(config.vocab_size)
    dim = head_dim(config)
    writer.add_rope_dimension_count(dim)
    if dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(dim)
        writer.add_value_length(dim)
    return _rope_scaling(writer, architecture, rope, config)


def _rope_parameters(config: Any) -> dict[str, Any]:
    """transformers' rotary settings: `rope_parameters`, or the older `rope_theta` and `rope_scaling`."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if not parameters:
        parameters = dict(getattr(config, "rope_scaling", None) or {})
        if getattr(config, "rope_theta", None) is not None:
            parameters["rope_theta"] = config.rope_theta
    return parameters


def _rope_scaling(writer: Any, architecture: Architecture, rope: dict[str, Any], config: Any) -> dict:
    import gguf

    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        return {}
    if kind == "llama3" and architecture.name == "llama":
        return {"rope_freqs.weight": llama3_rope_factors(rope, config)}
    raise GGUFExportError(
        f"rotary scaling {kind!r} is not written to GGUF by quantlab; supported: default, linear, llama3 (llama)"
    )


def llama3_rope_factors(rope: dict[str, Any], config: Any) -> torch.Tensor:
    """Llama 3.1's per-frequency rotary scaling, the `rope_freqs` tensor llama.cpp reads."""
    dim = head_dim(config)
    base = float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    context = float(rope.get("original_max_position_embeddings", 8192))
    factors = []
    for frequency in (1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).tolist():
        wavelength = 2 * math.pi / frequency
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)
