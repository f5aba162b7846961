"""Settings a transformers config may have that llama.cpp's graph of its architecture cannot express: each refused
in one line (a GGUFExportError naming the setting) rather than written as a file computing another model."""

from typing import TYPE_CHECKING, Any

from quantlab.export.gguf.errors import GGUFExportError
from quantlab.export.gguf.hyperparameters import head_dim, rope_kind, rope_parameters

if TYPE_CHECKING:
    from quantlab.export.gguf.architectures import Architecture

# transformers' GELUs; llama.cpp's GPT-2, GPT-NeoX and Falcon graphs compute the tanh approximation, which differs
# from the exact one by less than 5e-4 anywhere
_GELUS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def refuse_unexpressible(architecture: "Architecture", config: Any) -> None:
    """Raise GGUFExportError when `config` sets something llama.cpp's graph of `architecture` computes otherwise."""
    if architecture.normalizes_top_k is not None:
        _check_routing(architecture, config)
    check = _CHECKS.get(architecture.name)
    if check is not None:
        check(config)


def _check_routing(architecture: "Architecture", config: Any) -> None:
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
    local = rope_parameters(config, "sliding_attention")
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


def _check_gelu(name: str, key: str, config: Any) -> None:
    """llama.cpp's `name` graph has a GELU MLP: another activation in the config's `key` is refused."""
    activation = getattr(config, key)
    if activation not in _GELUS:
        raise GGUFExportError(f"llama.cpp's {name} graph's MLP computes GELU; this model has {key}={activation!r}")


def _check_gpt2(config: Any) -> None:
    """GPT-2 in llama.cpp: GELU, attention scores scaled by `1/sqrt(head_dim)` and nothing else."""
    _check_gelu("gpt2", "activation_function", config)
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        raise GGUFExportError(
            f"llama.cpp's gpt2 graph scales attention scores by 1/sqrt(head_dim) only; this model has "
            f"scale_attn_weights={config.scale_attn_weights}, "
            f"scale_attn_by_inverse_layer_idx={config.scale_attn_by_inverse_layer_idx}"
        )


def _check_gptneox(config: Any) -> None:
    """GPT-NeoX in llama.cpp: GELU, and biases on the attention's projections (which its graph loads)."""
    _check_gelu("gptneox", "hidden_act", config)
    if not getattr(config, "attention_bias", True):
        raise GGUFExportError(
            "llama.cpp's gptneox graph needs the attention's biases; this model has attention_bias=False"
        )


def _check_falcon(config: Any) -> None:
    """Falcon in llama.cpp: rotary positions, attention and MLP in parallel from the block's input, no biases, GELU."""
    _check_gelu("falcon", "activation", config)
    if config.alibi:
        raise GGUFExportError("llama.cpp's falcon graph has rotary positions, not ALiBi; this model has alibi=True")
    if not config.parallel_attn:
        raise GGUFExportError(
            "llama.cpp's falcon graph runs attention and MLP in parallel; this model has parallel_attn=False"
        )
    if config.bias:
        raise GGUFExportError("llama.cpp's falcon graph has no biases on its projections; this model has bias=True")


def _check_deepseek2(config: Any) -> None:
    """DeepSeek V3 in llama.cpp's deepseek2 graph: rotary on interleaved pairs (`rope_interleave`, the weights'
    layout), default or YaRN rotary, and YaRN's rotary scaled as transformers scales it (`mscale` equal to
    `mscale_all_dim`, which llama.cpp's graph assumes)."""
    if not getattr(config, "rope_interleave", True):
        raise GGUFExportError(
            "llama.cpp's deepseek2 graph rotates interleaved pairs of the weights' rows; this model has "
            "rope_interleave=False"
        )
    rope = rope_parameters(config)
    kind = rope_kind(rope)
    if kind not in ("default", "yarn"):
        raise GGUFExportError(f"llama.cpp's deepseek2 graph scales its rotary by YaRN only; this model's is {kind!r}")
    if kind == "yarn" and float(rope.get("mscale") or 0.0) != float(rope.get("mscale_all_dim") or 0.0):
        raise GGUFExportError(
            f"llama.cpp's deepseek2 graph scales YaRN's rotary as transformers does only when mscale equals "
            f"mscale_all_dim; this model has mscale={rope.get('mscale')}, mscale_all_dim={rope.get('mscale_all_dim')}"
        )


# Refusals of single architectures (by GGUF name)
_CHECKS = {
    "olmoe": _check_olmoe,
    "phi3": _check_phi3,
    "gemma2": _check_gemma2,
    "gemma3": _check_gemma3,
    "gpt2": _check_gpt2,
    "gptneox": _check_gptneox,
    "falcon": _check_falcon,
    "deepseek2": _check_deepseek2,
}
