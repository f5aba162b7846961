"""The hyperparameter keys of a GGUF file: what llama.cpp reads of each architecture, from the transformers config,
as llama.cpp's converter (`convert_hf_to_gguf.py`) writes them.

Every file has the context length, width, block count and head count; the rest depends on the graph: RMS-norm
graphs (Llama and its kin) their rotary settings and norm epsilon, GPT-2, GPT-NeoX and Falcon their LayerNorm
epsilon (and GPT-NeoX its partial rotary and parallel residual), DeepSeek its latent attention's ranks and widths,
its experts' routing and YaRN's rotary scaling.
"""

import math
from typing import TYPE_CHECKING, Any

import torch

from quantlab.export.gguf.errors import GGUFExportError

if TYPE_CHECKING:
    from quantlab.export.gguf.architectures import Architecture


def write_hyperparameters(writer: Any, architecture: "Architecture", config: Any) -> dict[str, torch.Tensor]:
    """Add the architecture's hyperparameter keys to `writer`; returns the extra tensors they need
    (Llama 3's `rope_freqs`)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    keys = _GRAPH_KEYS.get(architecture.name, _rms_norm_keys)
    return keys(writer, architecture, config)


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """transformers' rotary settings: `rope_parameters` (those of `layer_type` where they differ by layer type,
    as Gemma 3's do), or the older `rope_theta` and `rope_scaling`."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(parameters.get(layer_type), dict):
        return dict(parameters[layer_type])
    if not parameters:
        parameters = dict(getattr(config, "rope_scaling", None) or {})
        if getattr(config, "rope_theta", None) is not None:
            parameters["rope_theta"] = config.rope_theta
    return parameters


def rope_kind(rope: dict[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def falcon_kv_heads(config: Any) -> int:
    """How many key/value heads Falcon's fused projection holds: `num_kv_heads` groups (the new decoder
    architecture), one (multi-query) or one per query head."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


def _rms_norm_keys(writer: Any, architecture: "Architecture", config: Any) -> dict[str, torch.Tensor]:
    """Llama and its kin: the MLP width, key/value heads, rotary base and dimensions, RMS-norm epsilon, and the
    keys of single architectures (experts, multipliers, soft-caps, sliding windows)."""
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    if architecture.writes_vocab_size:
        writer.add_vocab_size(config.vocab_size)
    dim = head_dim(config)
    writer.add_rope_dimension_count(rotary_dim(rope, config))
    if dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(dim)
        writer.add_value_length(dim)
    if architecture.normalizes_top_k is not None:
        _write_experts(writer, architecture, config)
    keys = _KEYS.get(architecture.name)
    if keys is not None:
        keys(writer, config)
    return _rope_scaling(writer, architecture, rope, config)


def rotary_dim(rope: dict[str, Any], config: Any) -> int:
    """How many of each head's dimensions rotate (`partial_rotary_factor`, Phi-3's and GPT-NeoX's, may leave
    some out)."""
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim(config) * float(factor))


def _write_experts(writer: Any, architecture: "Architecture", config: Any) -> None:
    """The mixture-of-experts keys: how many experts, how many each token uses, their MLP widths."""
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if architecture.expert_width and getattr(config, architecture.expert_width, None):
        writer.add_expert_feed_forward_length(getattr(config, architecture.expert_width))
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _gpt2_keys(writer: Any, architecture: "Architecture", config: Any) -> dict[str, torch.Tensor]:
    """GPT-2: the MLP width (`n_inner`, four times the width when unset) and the LayerNorm epsilon; its positions
    are a learned table (`position_embd`), no rotary."""
    writer.add_feed_forward_length(config.n_inner or 4 * config.hidden_size)
    writer.add_layer_norm_eps(float(config.layer_norm_epsilon))
    return {}


def _gptneox_keys(writer: Any, architecture: "Architecture", config: Any) -> dict[str, torch.Tensor]:
    """GPT-NeoX: the MLP width, LayerNorm epsilon, whether attention and MLP read the same input
    (`use_parallel_residual`), and the rotary base and the dimensions it turns (`rotary_pct` of each head)."""
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_layer_norm_eps(float(config.layer_norm_eps))
    writer.add_parallel_residual(bool(config.use_parallel_residual))
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(rotary_dim(rope, config))
    return _rope_scaling(writer, architecture, rope, config)


def _falcon_keys(writer: Any, architecture: "Architecture", config: Any) -> dict[str, torch.Tensor]:
    """Falcon: the MLP width, key/value heads, LayerNorm epsilon, rotary base, and the fused projection's layout
    (`jploski`: all queries, then keys, then values, as the converter reorders them)."""
    writer.add_feed_forward_length(config.ffn_hidden_size)
    writer.add_head_count_kv(falcon_kv_heads(config))
    writer.add_layer_norm_eps(float(config.layer_norm_epsilon))
    writer.add_tensor_data_layout("jploski")
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    return _rope_scaling(writer, architecture, rope, config)


def _deepseek2_keys(writer: Any, architecture: "Architecture", config: Any) -> dict[str, torch.Tensor]:
    """DeepSeek V3 in llama.cpp's deepseek2 graph, its latent attention decompressed by `attn_kv_b` (every head its
    own keys and values: `key_length`, `value_length` per head, no `*_mla` keys), the dense first blocks, the
    routed and shared experts, sigmoid routing within groups, and YaRN's rotary scaling."""
    import gguf

    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count_kv(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_leading_dense_block_count(int(config.first_k_dense_replace))
    writer.add_q_lora_rank(int(config.q_lora_rank or 0))  # 0: one query projection (`attn_q`)
    writer.add_kv_lora_rank(int(config.kv_lora_rank))
    writer.add_key_length(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length(config.v_head_dim)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(float(config.routed_scaling_factor))
    writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_group_count(int(config.n_group))
    writer.add_expert_group_used_count(int(config.topk_group))
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if rope_kind(rope) == "yarn":
        _yarn(writer, rope)
    return {}


def _yarn(writer: Any, rope: dict[str, Any]) -> None:
    """YaRN: the factor, the context it extends, the frequency band it blends over (`beta_fast`, `beta_slow`) and
    the attention's `mscale_all_dim` (stored times 0.1, as llama.cpp's deepseek2 reads it)."""
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast") or 32.0))
    writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow") or 1.0))
    writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope.get("mscale_all_dim") or 0.0))


def _granite_keys(writer: Any, config: Any) -> None:
    """Granite's multipliers: llama.cpp scales the embeddings, both residual branches of each block and the
    attention scores by them (the attention's in place of `1/sqrt(head_dim)`), and divides the logits."""
    writer.add_embedding_scale(float(config.embedding_multiplier))
    writer.add_residual_scale(float(config.residual_multiplier))
    writer.add_attention_scale(float(config.attention_multiplier))
    writer.add_logit_scale(float(config.logits_scaling))


def _phi3_keys(writer: Any, config: Any) -> None:
    """Phi-3's sliding window (0: none; llama.cpp reads the key, runs full attention) and the context its
    rotary scaling starts from."""
    writer.add_sliding_window(int(getattr(config, "sliding_window", None) or 0))
    original = getattr(config, "original_max_position_embeddings", None)
    if original:
        writer.add_rope_scaling_orig_ctx_len(int(original))


def _gemma2_keys(writer: Any, config: Any) -> None:
    """Gemma 2's soft-caps of the attention scores and the logits, and its sliding window."""
    writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
    writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    writer.add_sliding_window(int(config.sliding_window))


def _gemma3_keys(writer: Any, config: Any) -> None:
    """Gemma 3's sliding window, the sliding layers' rotary base and the logits' soft-cap, if any."""
    writer.add_sliding_window(int(config.sliding_window))
    writer.add_rope_freq_base_swa(float(rope_parameters(config, "sliding_attention").get("rope_theta", 10000.0)))
    if getattr(config, "final_logit_softcapping", None) is not None:
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))


def _rope_scaling(writer: Any, architecture: "Architecture", rope: dict[str, Any], config: Any) -> dict:
    import gguf

    kind = rope_kind(rope)
    if kind == "default":
        return {}
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        return {}
    if kind == "llama3" and architecture.name == "llama":
        return {"rope_freqs.weight": llama3_rope_factors(rope, config)}
    raise GGUFExportError(
        f"rotary scaling {kind!r} is not written to GGUF by quantlab; supported: default, linear, llama3 (llama), "
        f"yarn (deepseek2)"
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


# The keys of single architectures (by GGUF name): whole graphs other than the RMS-norm family's, and the extra
# keys of members of that family
_GRAPH_KEYS = {"gpt2": _gpt2_keys, "gptneox": _gptneox_keys, "falcon": _falcon_keys, "deepseek2": _deepseek2_keys}
_KEYS = {"granite": _granite_keys, "phi3": _phi3_keys, "gemma2": _gemma2_keys, "gemma3": _gemma3_keys}
