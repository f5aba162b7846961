"""The transformers causal LMs llama.cpp runs that the GGUF export knows: their GGUF architecture,
hyperparameter keys and tensor names, as llama.cpp's own converter (`convert_hf_to_gguf.py`) writes them.

- `llama` (Llama 2/3, SmolLM2, ..., Mistral, and Mixtral, whose experts llama.cpp's `llama` graph runs):
  rotary embedding on interleaved pairs in llama.cpp, so the rows of the q and k projections are
  permuted from transformers' half-split layout (`rope_rows`).
- `qwen2`, `qwen3`: the same block with the half-split (NeoX) rotary layout, no permutation; Qwen2
  has q/k/v biases, Qwen3 RMS norms on each head's queries and keys (`attn_q_norm`, `attn_k_norm`).
- `qwen2moe`, `qwen3moe`: those blocks with a mixture of experts: a float router (`ffn_gate_inp`),
  the experts' projections as 3-D tensors (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`,
  `[experts, out, in]`), and Qwen2-MoE's shared expert (`*_shexp`) with its sigmoid gate.
"""

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from quantlab.export.gguf.errors import GGUFExportError


@dataclass(frozen=True)
class Architecture:
    """One architecture: `name` is GGUF's `general.architecture`; `model_type` is transformers'.

    `normalizes_top_k` (mixtures of experts): whether llama.cpp's graph of `name` renormalizes the
    routed experts' weights to sum to one; the transformers config must route the same way."""

    name: str
    model_type: str
    rope_permuted: bool  # q/k rows in llama.cpp's interleaved rotary layout
    writes_vocab_size: bool
    normalizes_top_k: bool | None = None  # None: not a mixture of experts


ARCHITECTURES = {
    architecture.model_type: architecture
    for architecture in (
        Architecture("llama", "llama", rope_permuted=True, writes_vocab_size=True),
        Architecture("llama", "mistral", rope_permuted=True, writes_vocab_size=True),
        Architecture("llama", "mixtral", rope_permuted=True, writes_vocab_size=True, normalizes_top_k=True),
        Architecture("qwen2", "qwen2", rope_permuted=False, writes_vocab_size=False),
        Architecture("qwen3", "qwen3", rope_permuted=False, writes_vocab_size=False),
        Architecture("qwen2moe", "qwen2_moe", rope_permuted=False, writes_vocab_size=False, normalizes_top_k=False),
        Architecture("qwen3moe", "qwen3_moe", rope_permuted=False, writes_vocab_size=False, normalizes_top_k=True),
    )
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
    (r"model\.layers\.(\d+)\.self_attn\.q_norm", r"blk.\1.attn_q_norm"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm", r"blk.\1.attn_k_norm"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm", r"blk.\1.ffn_norm"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj", r"blk.\1.ffn_gate"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj", r"blk.\1.ffn_up"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj", r"blk.\1.ffn_down"),
    (r"model\.layers\.(\d+)\.mlp\.gate", r"blk.\1.ffn_gate_inp"),
    (r"model\.layers\.(\d+)\.mlp\.experts", r"blk.\1.ffn_{}_exps"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.gate_proj", r"blk.\1.ffn_gate_shexp"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.up_proj", r"blk.\1.ffn_up_shexp"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.down_proj", r"blk.\1.ffn_down_shexp"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert_gate", r"blk.\1.ffn_gate_inp_shexp"),
]
_COMPILED = [(re.compile(pattern + r"$"), name) for pattern, name in _MODULE_NAMES]

# Matrices llama.cpp's converter keeps in float32 (routers: a rounded router picks other experts), and
# the ones it stores as a vector (Qwen2-MoE's shared-expert gate, `[1, hidden]` in transformers).
FLOAT32_MATRICES = (".ffn_gate_inp", ".ffn_gate_inp_shexp")
VECTORS = (".ffn_gate_inp_shexp",)

# The experts' projections in GGUF (`{}` of `ffn_{}_exps`): each names the fused parameter it is cut from
# and which half of its rows (gate and up share `gate_up_proj`: gate the first half, up the second).
EXPERT_PROJECTIONS = (("gate", "gate_up_proj", 0), ("up", "gate_up_proj", 1), ("down", "down_proj", None))


def architecture_of(model: Any) -> Architecture:
    """The architecture of a transformers causal LM; GGUFExportError naming the supported ones otherwise."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    architecture = ARCHITECTURES.get(model_type)
    if architecture is None:
        supported = ", ".join(ARCHITECTURES)
        raise GGUFExportError(
            f"a {model_type or type(model).__name__} model cannot be written as GGUF; supported model types: "
            f"{supported}"
        )
    if architecture.normalizes_top_k is not None:
        _check_routing(architecture, config)
    return architecture


def _check_routing(architecture: Architecture, config: Any) -> None:
    """Refuse a mixture of experts that llama.cpp's graph would route differently from transformers."""
    normalizes = getattr(config, "norm_topk_prob", True)  # Mixtral always renormalizes
    if bool(normalizes) != architecture.normalizes_top_k:
        raise GGUFExportError(
            f"llama.cpp's {architecture.name} graph {'always' if architecture.normalizes_top_k else 'never'} "
            f"renormalizes the routed experts' weights, but this model's config has norm_topk_prob={normalizes}: "
            f"the file would compute another model"
        )
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    if int(getattr(config, "decoder_sparse_step", 1) or 1) != 1 or dense:
        raise GGUFExportError(
            f"llama.cpp's {architecture.name} graph needs experts in every block; this model has dense MLP blocks "
            f"(mlp_only_layers={dense}, decoder_sparse_step={getattr(config, 'decoder_sparse_step', 1)})"
        )


def gguf_name(module_name: str) -> str | None:
    """The GGUF name of a module's tensors (`blk.0.attn_q`; `blk.0.ffn_{}_exps` for a block's experts, `{}`
    standing for gate, up or down), or None for a module GGUF has no tensor for."""
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
    if architecture.normalizes_top_k is not None:
        _write_experts(writer, config)
    return _rope_scaling(writer, architecture, rope, config)


def _write_experts(writer: Any, config: Any) -> None:
    """The mixture-of-experts keys: how many experts, how many each token uses, their MLP widths."""
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


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
