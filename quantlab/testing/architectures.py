"""Tiny configs of the causal language models people quantize, one per architecture, built from each config class.

Every model has two blocks, a hidden size of 64 and a vocabulary of 256, so a test can quantize
it in well under a second; the mixture-of-experts models have four to eight experts.
"""

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

_SHARED: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

# model_type -> the options that make its config tiny (on top of _SHARED, which each may override)
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma2": {"head_dim": 16},
    "gemma3_text": {"head_dim": 16},
    "phi3": {"pad_token_id": 0},
    "olmo2": {},
    "granite": {},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64, "num_key_value_heads": None, "intermediate_size": None},
    "gpt_neox": {"num_key_value_heads": None},
    "falcon": {"num_key_value_heads": None, "intermediate_size": None, "new_decoder_architecture": False},
    # GPT2Config maps hidden_size, num_hidden_layers, num_attention_heads and max_position_embeddings to its n_embd,
    # n_layer, n_head and n_positions; its projections are `Conv1D` layers, `c_attn` fusing queries, keys and values.
    "gpt2": {
        "num_key_value_heads": None,
        "intermediate_size": None,
        "n_inner": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mixtral": {"num_local_experts": 4},
    "qwen2_moe": {**_MOE, "shared_expert_intermediate_size": 64},
    "qwen3_moe": {**_MOE, "head_dim": 16},
    "olmoe": {**_MOE, "num_experts": 4},
    "deepseek_v3": {
        # As DeepSeek-V3's own config: its attention expands keys to every head, so transformers' sdpa path repeats
        # them again when there are fewer key/value heads, and a padded batch then fails.
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    },
}
MIXTURES_OF_EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


def tiny_config(model_type: str) -> Any:
    """The tiny config of `model_type` (a key of `ARCHITECTURES`)."""
    options = {**_SHARED, **ARCHITECTURES[model_type]}
    options = {name: value for name, value in options.items() if value is not None}
    if model_type == "opt":
        options["ffn_dim"] = options.pop("ffn_dim")
    config = AutoConfig.for_model(model_type, **options)
    config._experts_implementation = "eager"  # routes as quantlab's experts do, so outputs compare
    return config


def tiny_causal_lm(model_type: str, seed: int = 0) -> PreTrainedModel:
    """A seeded tiny causal LM of `model_type`, in eval mode."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
