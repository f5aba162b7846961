"""Tiny transformers models built from configs, for tests that must not download anything."""

import os
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from quantlab.testing.tokenizer import byte_tokenizer

# The sizes both tiny causal LMs share: 4 attention heads over 2 key/value heads, MLPs of 192.
_DECODER_SIZES = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def tiny_llama(seed: int = 0, tie_word_embeddings: bool = False) -> LlamaForCausalLM:
    """A 2-layer Llama whose Linear layers have 64, 128 and 96 input features."""
    torch.manual_seed(seed)
    config = LlamaConfig(**_DECODER_SIZES, tie_word_embeddings=tie_word_embeddings)
    return LlamaForCausalLM(config).eval()


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 (Llama's block with q/k/v biases, here drawn from N(0, 0.5) so that they matter)."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**_DECODER_SIZES, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_(0, 0.5)
    return model


def tiny_bert(seed: int = 0) -> BertModel:
    """A 2-layer BERT encoder."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    return BertModel(config).eval()


def tiny_model_dir(model: PreTrainedModel, directory: str | os.PathLike) -> Path:
    """Save `model` as a float safetensors checkpoint and return its folder."""
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory


def tiny_llama_checkpoint(
    directory: str | os.PathLike,
    seed: int = 0,
    model: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """A checkpoint folder the commands can read: `model` (default: `tiny_llama(seed)`) and `tokenizer`
    (default: `byte_tokenizer()`) saved into `directory`."""
    directory = tiny_model_dir(model if model is not None else tiny_llama(seed), directory)
    (tokenizer if tokenizer is not None else byte_tokenizer()).save_pretrained(directory)
    return directory
