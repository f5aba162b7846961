"""The distillation loss: its formula, token masking, normalization, a frozen teacher, clear mismatches."""

import types

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from quantlab.distill import (
    DistillationConfig,
    DistillationLoss,
    HiddenStateProjection,
    VocabularyMismatchError,
    check_vocabularies,
    distillation_trainer,
    token_kl,
)
from quantlab.errors import ConfigError
from quantlab.testing import tiny_llama
from quantlab.training import CausalLMCollator, TokenSequences, training_arguments


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(1, 256, (n,), generator=generator)} for n in (10, 7)]
    return CausalLMCollator(pad_token_id=0)(examples)  # the second row is padded


def _fake_trainer(teacher, projection=None):
    extra = {"teacher": teacher}
    if projection is not None:
        extra["hidden_projection"] = projection
    return types.SimpleNamespace(extra_modules=extra)


def test_token_kl_is_the_kl_divergence():
    t, s = torch.randn(5, 11), torch.randn(5, 11)
    p = F.softmax(t / 2, -1)
    expected = (p * (p.log() - F.log_softmax(s / 2, -1))).sum(-1)
    torch.testing.assert_close(token_kl(t, s, temperature=2.0), expected)
    assert float(token_kl(t, t).abs().max()) < 1e-6


@pytest.mark.parametrize(("alpha", "temperature"), [(0.5, 2.0), (1.0, 1.0), (0.0, 3.0)])
def test_loss_is_alpha_t2_kl_plus_one_minus_alpha_ce_over_the_scored_tokens(alpha, temperature):
    teacher, student = tiny_llama(0), tiny_llama(1)
    batch = _batch()
    num_items = 20  # the whole optimizer step's tokens, of which this micro-batch has 9 + 6
    output = DistillationLoss(DistillationConfig(alpha=alpha, temperature=temperature))(
        _fake_trainer(teacher), student, batch, num_items
    )
    scored = batch["labels"][:, 1:] != -100
    s_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1][scored]
    t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1][scored]
    kl = token_kl(t_logits, s_logits, temperature).sum() / num_items
    ce = F.cross_entropy(s_logits, batch["labels"][:, 1:][scored], reduction="sum") / num_items
    torch.testing.assert_close(output.loss, alpha * temperature**2 * kl + (1 - alpha) * ce)
    torch.testing.assert_close(output.metrics["kl"], kl)
    torch.testing.assert_close(output.metrics["ce"], ce)


def test_teacher_gets_no_gradient_and_student_does():
    teacher, student = tiny_llama(0), tiny_llama(1)
    output = DistillationLoss()(_fake_trainer(teacher), student, _batch(), 15)
    output.loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert student.model.layers[0].mlp.up_proj.weight.grad is not None


def test_hidden_state_matching_trains_the_projection():
    teacher, student = tiny_llama(0), tiny_llama(1)
    projection = HiddenStateProjection(64, 64, pairs=2)
    assert torch.equal(projection.projections[0].weight, torch.eye(64))  # equal sizes start as identity
    config = DistillationConfig(hidden_weight=0.5, hidden_layers=[(1, 1), (-1, -1)])
    output = DistillationLoss(config)(_fake_trainer(teacher, projection), student, _batch(), 15)
    assert float(output.metrics["hidden_mse"]) > 0
    output.loss.backward()
    assert projection.projections[1].weight.grad is not None


def _llama(vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_vocabulary_mismatch_is_a_clear_error(tmp_path):
    with pytest.raises(VocabularyMismatchError, match="teacher predicts 256 tokens, the student 300"):
        check_vocabularies(tiny_llama(), _llama(300))
    config = training_arguments({"output_dir": str(tmp_path), "max_steps": 1})
    data = TokenSequences([torch.arange(8)] * 4)
    with pytest.raises(VocabularyMismatchError, match="vocabularies differ"):
        distillation_trainer(_llama(300), tiny_llama(), config, data)
    tokenizer = types.SimpleNamespace(get_vocab=lambda: {chr(97 + i): i for i in range(26)})
    shuffled = _swapped_tokenizer(tokenizer)
    with pytest.raises(VocabularyMismatchError, match="tokenizers differ"):
        check_vocabularies(tiny_llama(), tiny_llama(1), tokenizer, shuffled)
    check_vocabularies(tiny_llama(), tiny_llama(1), tokenizer, tokenizer)


def _swapped_tokenizer(tokenizer):
    """The same tokens with two ids exchanged."""
    vocab = tokenizer.get_vocab()
    first, second = sorted(vocab, key=vocab.get)[:2]
    swapped = dict(vocab)
    swapped[first], swapped[second] = vocab[second], vocab[first]
    return types.SimpleNamespace(get_vocab=lambda: swapped)


def test_config_values_are_checked():
    for bad in (
        {"alpha": 1.5},
        {"temperature": 0},
        {"hidden_weight": -1},
        {"hidden_layers": [(1,)]},
        {"embedding_weight": -0.5},
    ):
        with pytest.raises(ConfigError):
            DistillationConfig(**bad)
