"""Structured pruning: smaller matrices that compute what the original computes without the removed units."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import quantlab
from quantlab.prune import PruningError, prune_structured
from quantlab.prune.structured import decoder_blocks
from quantlab.testing import tiny_bert, tiny_llama


def _zero_removed_units(original, pruned) -> None:
    """Zero, in `original`, the neurons and query heads that `pruned` no longer has (matched by weights)."""
    for block, kept in zip(decoder_blocks(original), decoder_blocks(pruned), strict=True):
        gate, kept_gate = block.mlp.gate_proj.weight, kept.mlp.gate_proj.weight
        present = (gate.unsqueeze(1) == kept_gate.unsqueeze(0)).all(-1).any(1)
        with torch.no_grad():
            block.mlp.down_proj.weight[:, ~present] = 0
        q, kept_q = block.attention.q_proj.weight, kept.attention.q_proj.weight
        rows = (q.unsqueeze(1) == kept_q.unsqueeze(0)).all(-1).any(1)
        with torch.no_grad():
            block.attention.o_proj.weight[:, ~rows] = 0


@pytest.mark.parametrize(("mlp", "heads"), [(0.25, 0.0), (0.5, 0.5), (0.0, 0.5)])
def test_pruned_model_equals_the_original_with_those_units_zeroed(mlp, heads):
    model = tiny_llama()
    original = copy.deepcopy(model)
    result = prune_structured(model, mlp_sparsity=mlp, head_sparsity=heads)
    assert result.intermediate_size == (192, 192 - round(mlp * 192))
    assert result.attention_heads == (4, 2 if heads else 4)  # one of the 2 query heads per key/value head
    _zero_removed_units(original, model)
    x = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(model(x).logits, original(x).logits, atol=1e-5, rtol=1e-5)


def test_matrices_and_config_really_shrink_and_reload_without_quantlab_help(tmp_path):
    model = tiny_llama()
    before = sum(p.numel() for p in model.parameters())
    prune_structured(model, mlp_sparsity=0.25, head_sparsity=0.5)
    mlp = model.model.layers[0].mlp
    attention = model.model.layers[0].self_attn
    assert mlp.gate_proj.weight.shape == (144, 64) and mlp.down_proj.weight.shape == (64, 144)
    assert attention.q_proj.weight.shape == (32, 64) and attention.o_proj.weight.shape == (64, 32)
    assert sum(p.numel() for p in model.parameters()) < before
    assert (model.config.intermediate_size, model.config.num_attention_heads, model.config.head_dim) == (144, 2, 16)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = torch.randint(0, 256, (1, 10))
    torch.testing.assert_close(reloaded(x).logits, model(x).logits)


def test_multi_head_attention_loses_whole_key_value_heads():
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    original = copy.deepcopy(model)
    prune_structured(model, head_sparsity=0.5)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (2, 2)
    x = torch.randint(0, 128, (1, 9))
    assert model(x).logits.shape == original(x).logits.shape


def test_calibration_scores_units_by_their_activations():
    model, twin = tiny_llama(), tiny_llama()
    batches = [{"input_ids": torch.randint(0, 256, (2, 16))} for _ in range(2)]
    prune_structured(model, mlp_sparsity=0.5, calibration=batches)
    prune_structured(twin, mlp_sparsity=0.5)
    assert model.config.intermediate_size == twin.config.intermediate_size == 96
    chosen = model.model.layers[0].mlp.gate_proj.weight
    by_norm = twin.model.layers[0].mlp.gate_proj.weight
    assert not torch.equal(chosen, by_norm)  # activations pick other neurons than weight norms


def test_structurally_pruned_model_quantizes_and_saves(tmp_path):
    model = tiny_llama()
    prune_structured(model, mlp_sparsity=0.5)
    quantlab.quantize(model, quantlab.NF4Config(blocksize=32))
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = torch.randint(0, 256, (1, 6))
    torch.testing.assert_close(reloaded(x).logits, model(x).logits)


def test_bad_inputs_are_named():
    with pytest.raises(PruningError, match="Llama-style"):
        prune_structured(tiny_bert(), mlp_sparsity=0.25)
    with pytest.raises(PruningError, match=r"smallest step is 0\.5"):
        prune_structured(tiny_llama(), head_sparsity=0.1)  # 2 query heads per key/value head
    with pytest.raises(PruningError, match="every attention head"):
        prune_structured(tiny_llama(), head_sparsity=0.9)
    with pytest.raises(quantlab.ConfigError, match=r"\[0, 1\)"):
        prune_structured(tiny_llama(), mlp_sparsity=1.0)
    quantized = quantlab.quantize(tiny_llama(), quantlab.Int8SymmetricConfig())
    with pytest.raises(PruningError, match="prune the float model first"):
        prune_structured(quantized, mlp_sparsity=0.25)
