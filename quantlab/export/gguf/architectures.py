"""The transformers causal LMs llama.cpp runs that the GGUF export knows: their GGUF architecture, tensor names and
row orders, as llama.cpp's own converter (`convert_hf_to_gguf.py`) writes them (hyperparameter keys:
`hyperparameters`; settings refused: `refusals`).

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
- `gpt2`: LayerNorms with biases, a learned position table (`position_embd`, F32 as the converter keeps it),
  queries, keys and values fused (`attn_qkv`, rows q, k, v), a GELU MLP; transformers' `Conv1D` layers store
  `W` transposed, so a float one is written as `W` (a quantized one already holds `W`'s rows).
- `gptneox`: LayerNorms with biases, partial rotary in the half-split layout, parallel or sequential residual,
  and the fused projection's rows, which transformers interleaves per head (q, k, v of head 0, then of
  head 1, ...), reordered to all queries, then keys, then values (`fused_qkv_rows`): whole rows move, codes
  stay exact.
- `falcon`: one or two LayerNorms before attention and MLP running in parallel (`attn_norm`, `attn_norm_2`),
  half-split rotary, and the fused projection's key/value groups (each group's queries, then its key and
  value) reordered to all queries, keys, values (the converter's `jploski` layout).
- `deepseek2` (transformers' `deepseek_v3`): multi-head latent attention (`attn_q_a`, `attn_q_b`,
  `attn_kv_a_mqa` and their norms) decompressed by `attn_kv_b` as transformers stores it, the layout
  llama.cpp runs as per-head attention: the converter's MLA-cache layout instead splits it into `attn_k_b`,
  transposed, whose codes would be grouped along the other axis, so quantlab keeps `attn_kv_b` and its
  codes. Dense first blocks, then routed experts with shared ones (`*_shexp`), routed by sigmoid scores
  plus a correction bias (`exp_probs_b`, F32) within the best groups.

Settings llama.cpp's graph of an architecture cannot express (another query scale, sliding-window
pattern or routing rule) are refused in one line rather than written as a file computing another model.
"""

import re
from dataclasses import dataclass
from typing import Any

import torch

from quantlab.export.gguf.errors import GGUFExportError
from quantlab.export.gguf.hyperparameters import falcon_kv_heads, head_dim
from quantlab.export.gguf.refusals import refuse_unexpressible


@dataclass(frozen=True)
class Architecture:
    """One architecture: `name` is GGUF's `general.architecture`; `model_type` is transformers'.

    `normalizes_top_k` (mixtures of experts): whether llama.cpp's graph of `name` renormalizes the
    routed experts' weights to sum to one; the transformers config must route the same way.
    `expert_width`: the config attribute holding the experts' MLP width when it is not `intermediate_size`.
    `post_norms`: `post_attention_layernorm` normalizes the attention's output (Gemma 2/3, OLMo 2),
    not the MLP's input. `norm_offset`: what the file adds to every norm's weight (Gemma: 1).
    `names`: which table of module names the model's modules follow (`MODULE_NAMES`)."""

    name: str
    model_type: str
    rope_permuted: bool  # q/k rows in llama.cpp's interleaved rotary layout
    writes_vocab_size: bool
    normalizes_top_k: bool | None = None  # None: not a mixture of experts, or routing keys of its own
    expert_width: str | None = None
    post_norms: bool = False
    norm_offset: float = 0.0
    names: str = "llama"


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
        Architecture("gpt2", "gpt2", rope_permuted=False, writes_vocab_size=False, names="gpt2"),
        Architecture("gptneox", "gpt_neox", rope_permuted=False, writes_vocab_size=False, names="gptneox"),
        Architecture("falcon", "falcon", rope_permuted=False, writes_vocab_size=False, names="falcon"),
        Architecture("deepseek2", "deepseek_v3", rope_permuted=False, writes_vocab_size=True),
    )
}

_BLOCK = r"model\.layers\.(\d+)\."
# transformers module name → GGUF tensor name (without the `.weight` / `.bias` suffix), per table of names
MODULE_NAMES = {
    "llama": [
        (r"model\.embed_tokens", "token_embd"),
        (r"model\.norm", "output_norm"),
        (r"lm_head", "output"),
        (_BLOCK + r"input_layernorm", r"blk.\1.attn_norm"),
        (_BLOCK + r"self_attn\.q_proj", r"blk.\1.attn_q"),
        (_BLOCK + r"self_attn\.k_proj", r"blk.\1.attn_k"),
        (_BLOCK + r"self_attn\.v_proj", r"blk.\1.attn_v"),
        (_BLOCK + r"self_attn\.qkv_proj", r"blk.\1.attn_qkv"),
        (_BLOCK + r"self_attn\.o_proj", r"blk.\1.attn_output"),
        (_BLOCK + r"self_attn\.q_norm", r"blk.\1.attn_q_norm"),
        (_BLOCK + r"self_attn\.k_norm", r"blk.\1.attn_k_norm"),
        (_BLOCK + r"self_attn\.q_a_proj", r"blk.\1.attn_q_a"),
        (_BLOCK + r"self_attn\.q_a_layernorm", r"blk.\1.attn_q_a_norm"),
        (_BLOCK + r"self_attn\.q_b_proj", r"blk.\1.attn_q_b"),
        (_BLOCK + r"self_attn\.kv_a_proj_with_mqa", r"blk.\1.attn_kv_a_mqa"),
        (_BLOCK + r"self_attn\.kv_a_layernorm", r"blk.\1.attn_kv_a_norm"),
        (_BLOCK + r"self_attn\.kv_b_proj", r"blk.\1.attn_kv_b"),
        (_BLOCK + r"post_attention_layernorm", r"blk.\1.ffn_norm"),
        (_BLOCK + r"pre_feedforward_layernorm", r"blk.\1.ffn_norm"),
        (_BLOCK + r"post_feedforward_layernorm", r"blk.\1.post_ffw_norm"),
        (_BLOCK + r"mlp\.gate_up_proj", r"blk.\1.ffn_up"),
        (_BLOCK + r"mlp\.gate_proj", r"blk.\1.ffn_gate"),
        (_BLOCK + r"mlp\.up_proj", r"blk.\1.ffn_up"),
        (_BLOCK + r"mlp\.down_proj", r"blk.\1.ffn_down"),
        (_BLOCK + r"mlp\.gate", r"blk.\1.ffn_gate_inp"),
        (_BLOCK + r"mlp\.experts", r"blk.\1.ffn_{}_exps"),
        (_BLOCK + r"mlp\.shared_experts?\.gate_proj", r"blk.\1.ffn_gate_shexp"),
        (_BLOCK + r"mlp\.shared_experts?\.up_proj", r"blk.\1.ffn_up_shexp"),
        (_BLOCK + r"mlp\.shared_experts?\.down_proj", r"blk.\1.ffn_down_shexp"),
        (_BLOCK + r"mlp\.shared_expert_gate", r"blk.\1.ffn_gate_inp_shexp"),
    ],
    "gpt2": [
        (r"transformer\.wte", "token_embd"),
        (r"transformer\.wpe", "position_embd"),
        (r"transformer\.ln_f", "output_norm"),
        (r"lm_head", "output"),
        (r"transformer\.h\.(\d+)\.ln_1", r"blk.\1.attn_norm"),
        (r"transformer\.h\.(\d+)\.attn\.c_attn", r"blk.\1.attn_qkv"),
        (r"transformer\.h\.(\d+)\.attn\.c_proj", r"blk.\1.attn_output"),
        (r"transformer\.h\.(\d+)\.ln_2", r"blk.\1.ffn_norm"),
        (r"transformer\.h\.(\d+)\.mlp\.c_fc", r"blk.\1.ffn_up"),
        (r"transformer\.h\.(\d+)\.mlp\.c_proj", r"blk.\1.ffn_down"),
    ],
    "gptneox": [
        (r"gpt_neox\.embed_in", "token_embd"),
        (r"gpt_neox\.final_layer_norm", "output_norm"),
        (r"lm_head|embed_out", "output"),
        (r"gpt_neox\.layers\.(\d+)\.input_layernorm", r"blk.\1.attn_norm"),
        (r"gpt_neox\.layers\.(\d+)\.attention\.query_key_value", r"blk.\1.attn_qkv"),
        (r"gpt_neox\.layers\.(\d+)\.attention\.dense", r"blk.\1.attn_output"),
        (r"gpt_neox\.layers\.(\d+)\.post_attention_layernorm", r"blk.\1.ffn_norm"),
        (r"gpt_neox\.layers\.(\d+)\.mlp\.dense_h_to_4h", r"blk.\1.ffn_up"),
        (r"gpt_neox\.layers\.(\d+)\.mlp\.dense_4h_to_h", r"blk.\1.ffn_down"),
    ],
    "falcon": [
        (r"transformer\.word_embeddings", "token_embd"),
        (r"transformer\.ln_f", "output_norm"),
        (r"lm_head", "output"),
        (r"transformer\.h\.(\d+)\.(input_layernorm|ln_attn)", r"blk.\1.attn_norm"),
        (r"transformer\.h\.(\d+)\.ln_mlp", r"blk.\1.attn_norm_2"),
        (r"transformer\.h\.(\d+)\.self_attention\.query_key_value", r"blk.\1.attn_qkv"),
        (r"transformer\.h\.(\d+)\.self_attention\.dense", r"blk.\1.attn_output"),
        (r"transformer\.h\.(\d+)\.mlp\.dense_h_to_4h", r"blk.\1.ffn_up"),
        (r"transformer\.h\.(\d+)\.mlp\.dense_4h_to_h", r"blk.\1.ffn_down"),
    ],
}
# ... and where a norm follows the attention (`Architecture.post_norms`), the names that differ
_POST_NORM_NAMES = [(_BLOCK + r"post_attention_layernorm", r"blk.\1.post_attention_norm")]
_COMPILED = {
    table: [(re.compile(f"(?:{pattern})$"), name) for pattern, name in names] for table, names in MODULE_NAMES.items()
}
_POST_NORM_COMPILED = [(re.compile(pattern + r"$"), name) for pattern, name in _POST_NORM_NAMES]

# Matrices llama.cpp's converter keeps in float32 (routers: a rounded router picks other experts; GPT-2's position
# table), and the ones it stores as a vector (Qwen2-MoE's shared-expert gate, `[1, hidden]` in transformers).
FLOAT32_MATRICES = ("ffn_gate_inp", "ffn_gate_inp_shexp", "position_embd")
VECTORS = (".ffn_gate_inp_shexp",)
# Buffers a module holds that the file needs, by buffer name → GGUF name within the module's block: DeepSeek's
# router adds `e_score_correction_bias` to its scores to choose experts.
BUFFERS = {"e_score_correction_bias": "exp_probs_b.bias"}

# The experts' projections in GGUF (`{}` of `ffn_{}_exps`): each names the fused parameter it is cut from
# and which half of its rows (gate and up share `gate_up_proj`: gate the first half, up the second).
EXPERT_PROJECTIONS = (("gate", "gate_up_proj", 0), ("up", "gate_up_proj", 1), ("down", "down_proj", None))


def architecture_of(model: Any) -> Architecture:
    """The architecture of a transformers causal LM; GGUFExportError naming the supported ones otherwise, or the
    setting its llama.cpp graph cannot express."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    architecture = ARCHITECTURES.get(model_type)
    if architecture is None:
        supported = ", ".join(ARCHITECTURES)
        raise GGUFExportError(
            f"a {model_type or type(model).__name__} model cannot be written as GGUF; supported model types: "
            f"{supported}"
        )
    refuse_unexpressible(architecture, config)
    return architecture


def gguf_name(module_name: str, architecture: Architecture) -> str | None:
    """The GGUF name of a module's tensors in `architecture` (`blk.0.attn_q`; `blk.0.ffn_{}_exps` for a block's
    experts, `{}` standing for gate, up or down), or None for a module GGUF has no tensor for."""
    names = _COMPILED[architecture.names]
    if architecture.post_norms:
        names = _POST_NORM_COMPILED + names
    for pattern, name in names:
        if pattern.match(module_name):
            return pattern.sub(name, module_name)
    return None


def is_float32(gguf_base: str) -> bool:
    """Whether the matrix `gguf_base` stays float32 in the file whatever the fallback type."""
    return gguf_base.rpartition(".")[2] in FLOAT32_MATRICES


def rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter gives a q or k projection of `heads` heads: within each head,
    the two halves of transformers' rotary layout interleaved (row i of each half becomes rows 2i, 2i+1)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, 2, half).transpose(1, 2).reshape(-1)


def fused_qkv_rows(rows: int, groups: int, dim: int) -> torch.Tensor:
    """The row order llama.cpp reads a fused projection in (every query head, then every key head, then every value
    head) from transformers' `groups` groups of heads of `dim` rows, each group its queries, then one key head and
    one value head (Falcon's key/value groups; GPT-NeoX's heads, one query each). Whole rows move: codes and scales
    stay exact."""
    heads = torch.arange(rows).reshape(groups, rows // groups // dim, dim)
    return torch.cat([heads[:, :-2].reshape(-1), heads[:, -2].reshape(-1), heads[:, -1].reshape(-1)])


def _gptneox_groups(config: Any) -> int:
    return config.num_attention_heads


# Architectures whose fused projection transformers stores in groups (by GGUF name) → how many groups
_QKV_GROUPS = {"gptneox": _gptneox_groups, "falcon": falcon_kv_heads}


def permutation(architecture: Architecture, config: Any, gguf_base: str, rows: int) -> torch.Tensor | None:
    """The rows to gather from a q/k projection or a fused one (weight or bias) of `architecture`, or None to
    keep the order."""
    if gguf_base.endswith(".attn_qkv") and architecture.name in _QKV_GROUPS:
        return fused_qkv_rows(rows, _QKV_GROUPS[architecture.name](config), head_dim(config))
    if not architecture.rope_permuted:
        return None
    if gguf_base.endswith(".attn_q"):
        return rope_rows(rows, config.num_attention_heads)
    if gguf_base.endswith(".attn_k"):
        return rope_rows(rows, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return None
