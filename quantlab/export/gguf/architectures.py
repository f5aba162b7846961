"""The transformers causal LMs llama.cpp runs that the GGUF export knows: their GGUF architecture,
hyperparameter keys and tensor names, as llama.cpp's own converter (`convert_hf_to_gguf.py`) writes them.

- `llama` (Llama 2/3, SmolLM2, ..., Mistral, and Mixtral, whose experts llama.cpp's `llama` graph runs):
  rotary embedding on interleaved pairs in llama.cpp, so the rows of the q and k projections are
  permuted from transformers' half-split layout (`rope_rows`).
- `granite`: the Llama block and layout with four scalars (`embedding_scale`, `residual_scale`,
  `attention.scale`, `logit_scale`: transformers' embedding, residual and attention multipliers and
  the divisor of the logits).
- `qwen2`, `qwen3`: the same block with the half-split (NeoX) rotary layout, no permutation; Qwen2
  has q/k/v biases, Qwen3 RMS norms on each head's queries and keys (`attn_q_norm`, `attn_k_norm`).
- `phi3`: half-split rotary layout, queries, keys and values fused in one projection (`attn_qkv`,
  rows q, k, v) and the MLP's gate and up in one (`ffn_up`, gate the first half).
- `gemma2`, `gemma3` (transformers' `gemma3_text`): half-split rotary layout, a norm after the
  attention and after the MLP too (`post_attention_norm`, `post_ffw_norm`), every RMS norm scaling
  by `1 + weight` (the file holds `1 + weight`, as llama.cpp multiplies by the weight), soft-capped
  attention and logits (Gemma 2), per-head q/k norms (Gemma 3), sliding-window attention on a fixed
  pattern of layers.
- `olmo2`: half-split rotary layout, norms after the attention and the MLP only, q/k norms over the
  whole projection.
- `qwen2moe`, `qwen3moe`, `olmoe`: mixtures of experts: a float router (`ffn_gate_inp`), the experts'
  projections as 3-D tensors (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, `[experts, out, in]`),
  and Qwen2-MoE's shared expert (`*_shexp`) with its sigmoid gate; OLMoE's blocks are OLMo 2's q/k
  norms with pre-norms.

Settings llama.cpp's graph of an architecture cannot express (another query scale, sliding-window
pattern or routing rule) are refused in one line rather than written as a file computing another model.
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
    routed experts' weights to sum to one; the transformers config must route the same way.
    `expert_width`: the config attribute holding the experts' MLP width when it is not `intermediate_size`.
    `post_norms`: `post_attention_layernorm` normalizes the attention's output (Gemma 2/3, OLMo 2),
    not the MLP's input. `norm_offset`: what the file adds to every norm's weight (Gemma: 1)."""

    name: str
    model_type: str
    rope_permuted: bool  # q/k rows in llama.cpp's interleaved rotary layout
    writes_vocab_size: bool
    normalizes_top_k: bool | None = None  # None: not a mixture of experts
    expert_width: str | None = None
    post_norms: bool = False
    norm_offset: float = 0.0


ARCHITECTURES = {
    architecture.model_type: architecture
    for architecture in (
        Architecture("llama", "llama", rope_permuted=True, writes_vocab_size=True),
        Architecture("llama", "mistral", rope_permuted=True, writes_vocab_size=True),
        Architecture("llama", "mixtral", rope_permuted=True, writes_vocab_size=True, normalizes_top_k=True),
        Architecture("qwen2", "qwen2", rope_permuted=False, writes_vocab_size=False),
        Architecture("qwen3", "qwen3", rope_permuted=False, writes_vocab_size=False),
        Architecture(
            "qwen2moe",
            "qwen2_moe",
            rope_permuted=False,
            writes_vocab_size=False,
            normalizes_top_k=False,
            expert_width="moe_intermediate_size",
        ),
        Architecture(
            "qwen3moe",
            "qwen3_moe",
            rope_permuted=False,
            writes_vocab_size=False,
            normalizes_top_k=True,
            expert_width="moe_intermediate_size",
        ),
        Architecture("olmoe", "olmoe", rope_permuted=False, writes_vocab_size=False, normalizes_top_k=False),
        Architecture("granite", "granite", rope_permuted=True, writes_vocab_size=True),
        Architecture("phi3", "phi3", rope_permuted=False, writes_vocab_size=False),
        Architecture(
            "gemma2", "gemma2", rope_permuted=False, writes_vocab_size=False, post_norms=True, norm_offset=1.0
        ),
        Architecture(
            "gemma3", "gemma3_text", rope_permuted=False, writes_vocab_size=False, post_norms=True, norm_offset=1.0
        ),
        Architecture("olmo2", "olmo2", rope_permuted=False, writes_vocab_size=False, post_norms=True),
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
    (r"model\.layers\.(\d+)\.self_attn\.qkv_proj", r"blk.\1.attn_qkv"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj", r"blk.\1.attn_output"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm", r"blk.\1.attn_q_norm"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm", r"blk.\1.attn_k_norm"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm", r"blk.\1.ffn_norm"),
    (r"model\.layers\.(\d+)\.pre_feedforward_layernorm", r"blk.\1.ffn_norm"),
    (r"model\.layers\.(\d+)\.post_feedforward_layernorm", r"blk.\1.post_ffw_norm"),
    (r"model\.layers\.(\d+)\.mlp\.gate_up_proj", r"blk.\1.ffn_up"),
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
# ... and where a norm follows the attention (`Architecture.post_norms`), the names that differ
_POST_NORM_NAMES = [(r"model\.layers\.(\d+)\.post_attention_layernorm", r"blk.\1.post_attention_norm")]
_COMPILED = [(re.compile(pattern + r"$"), name) for pattern, name in _MODULE_NAMES]
_POST_NORM_COMPILED = [(re.compile(pattern + r"$"), name) for pattern, name in _POST_NORM_NAMES]

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
    check = _CHECKS.get(architecture.name)
    if check is not None:
        check(config)
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


def _check_olmoe(config: Any) -> None:
    """llama.cpp's olmoe graph has no clamp of the queries, keys and values (OLMo 1's `clip_qkv`), and its key
    norm is as wide as the hidden state: as many key/value heads as query heads."""
    if getattr(config, "clip_qkv", None) is not None:
        raise GGUFExportError(
            f"llama.cpp's olmoe graph does not clip queries, keys and values; this model has clip_qkv={config.clip_qkv}"
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads != config.num_attention_heads:
        raise GGUFExportError(
            f"llama.cpp's olmoe graph needs as many key/value heads as query heads ({config.num_attention_heads}); "
            f"this model has {kv_heads}"
        )


def _check_phi3(config: Any) -> None:
    """llama.cpp runs Phi-3 with full attention: a sliding window shorter than the context is refused."""
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        raise GGUFExportError(
            f"llama.cpp's phi3 graph ignores the sliding window; this model attends over {window} tokens of its "
            f"{config.max_position_embeddings}, so the file would compute another model on longer inputs"
        )


def _check_gemma2(config: Any) -> None:
    """Gemma 2 in llama.cpp: both soft-caps always applied (50 and 30 when the file has none)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None) is None:
            raise GGUFExportError(f"llama.cpp's gemma2 graph always soft-caps; this model has {key}=None")
    _check_gemma_attention("gemma2", config, period=2, layers_27b=46)


def _check_gemma3(config: Any) -> None:
    """Gemma 3 in llama.cpp: causal, no attention soft-cap, the sliding layers' rotary never scaled."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise GGUFExportError(
            f"llama.cpp's gemma3 graph has no attention soft-cap; this model has "
            f"attn_logit_softcapping={config.attn_logit_softcapping}"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise GGUFExportError("llama.cpp's gemma3 graph is causal; this model has use_bidirectional_attention=True")
    local = _rope_parameters(config, "sliding_attention")
    if local.get("rope_type", "default") != "default":
        raise GGUFExportError(
            f"llama.cpp's gemma3 graph never scales the sliding-window layers' rotary; this model's is {local}"
        )
    _check_gemma_attention("gemma3", config, period=6, layers_27b=62)


def _check_gemma_attention(name: str, config: Any, period: int, layers_27b: int) -> None:
    """llama.cpp's Gemma graphs fix two things a config may set otherwise: the query scale,
    `1/sqrt(head_dim)` (`1/sqrt(hidden / heads)` at the 27B model's block count), and which layers
    attend through the sliding window (which they need): all but every `period`-th."""
    if not getattr(config, "sliding_window", None):
        raise GGUFExportError(f"llama.cpp's {name} graph needs the sliding layers' window; this model has none")
    layers = config.num_hidden_layers
    scalar = config.hidden_size // config.num_attention_heads if layers == layers_27b else head_dim(config)
    if float(config.query_pre_attn_scalar) != float(scalar):
        raise GGUFExportError(
            f"llama.cpp's {name} graph scales queries by 1/sqrt({scalar}) for this model; its config has "
            f"query_pre_attn_scalar={config.query_pre_attn_scalar}"
        )
    expected = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]
    layer_types = list(getattr(config, "layer_types", None) or expected)
    if layer_types != expected:
        raise GGUFExportError(
            f"llama.cpp's {name} graph uses a full-attention layer every {period} layers, the others sliding; "
            f"this model has layer_types={layer_types}"
        )


def gguf_name(module_name: str, architecture: Architecture) -> str | None:
    """The GGUF name of a module's tensors in `architecture` (`blk.0.attn_q`; `blk.0.ffn_{}_exps` for a block's
    experts, `{}` standing for gate, up or down), or None for a module GGUF has no tensor for."""
    names = _POST_NORM_COMPILED + _COMPILED if architecture.post_norms else _COMPILED
    for pattern, name in names:
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
    writer.add_rope_dimension_count(_rotary_dim(rope, config))
    if dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(dim)
        writer.add_value_length(dim)
    if architecture.normalizes_top_k is not None:
        _write_experts(writer, architecture, config)
    keys = _KEYS.get(architecture.name)
    if keys is not None:
        keys(writer, config)
    return _rope_scaling(writer, architecture, rope, config)


def _rotary_dim(rope: dict[str, Any], config: Any) -> int:
    """How many of each head's dimensions rotate (Phi-3's `partial_rotary_factor` may leave some out)."""
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim(config) * float(factor))


def _write_experts(writer: Any, architecture: Architecture, config: Any) -> None:
    """The mixture-of-experts keys: how many experts, how many each token uses, their MLP widths."""
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if architecture.expert_width and getattr(config, architecture.expert_width, None):
        writer.add_expert_feed_forward_length(getattr(config, architecture.expert_width))
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


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
    writer.add_rope_freq_base_swa(float(_rope_parameters(config, "sliding_attention").get("rope_theta", 10000.0)))
    if getattr(config, "final_logit_softcapping", None) is not None:
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))


def _rope_parameters(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
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


# Refusals and hyperparameter keys of single architectures (by GGUF name)
_CHECKS = {"olmoe": _check_olmoe, "phi3": _check_phi3, "gemma2": _check_gemma2, "gemma3": _check_gemma3}
_KEYS = {"granite": _granite_keys, "phi3": _phi3_keys, "gemma2": _gemma2_keys, "gemma3": _gemma3_keys}
