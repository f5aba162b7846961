"""The chunked KL: the same sums and gradient as `token_kl` over the scored positions, at any temperature."""

import pytest
import torch
from torch.nn import functional as F

from quantlab.distill import chunked_kl
from quantlab.distill.chunked_kl import kl_and_cross_entropy
from quantlab.distill.loss import token_kl
from quantlab.training.data import IGNORE_INDEX


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sums_and_gradient_equal_the_plain_expression(monkeypatch, temperature):
    monkeypatch.setattr(chunked_kl, "CHUNK_BYTES", 4 * 50 * 7)  # 7 rows a chunk: chunks cross sequences
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(3, 11, 50, generator=generator, requires_grad=True)
    teacher = torch.randn(3, 11, 50, generator=generator)
    labels = torch.randint(0, 50, (3, 11), generator=generator)
    labels[1, 6:] = IGNORE_INDEX  # padding
    labels[2, 3] = IGNORE_INDEX
    kl, ce = kl_and_cross_entropy(student, teacher, labels, temperature)
    kl.backward()
    got = student.grad.clone()
    student.grad = None
    scored = labels[:, 1:] != IGNORE_INDEX
    expected_kl = token_kl(teacher[:, :-1][scored], student[:, :-1][scored], temperature).sum()
    expected_ce = F.cross_entropy(student[:, :-1][scored], labels[:, 1:][scored], reduction="sum")
    expected_kl.backward()
    assert torch.allclose(kl, expected_kl, rtol=1e-5)
    assert torch.allclose(ce, expected_ce.detach(), rtol=1e-5)
    assert torch.allclose(got, student.grad, rtol=1e-4, atol=1e-7)
    assert torch.all(got[:, -1] == 0) and torch.all(got[1, 5:] == 0)


def test_without_gradients_it_keeps_nothing_and_gives_the_same_sums():
    student, teacher = torch.randn(2, 5, 9), torch.randn(2, 5, 9)
    labels = torch.randint(0, 9, (2, 5))
    with torch.no_grad():
        kl, ce = kl_and_cross_entropy(student, teacher, labels)
    kl_grad, ce_grad = kl_and_cross_entropy(student.requires_grad_(True), teacher, labels)
    assert torch.allclose(kl, kl_grad.detach()) and torch.equal(ce, ce_grad)


@pytest.mark.parametrize("head_trains", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_the_chunked_head_gives_the_whole_logits_loss_and_gradients(monkeypatch, tied, head_trains):
    from transformers import AutoModelForCausalLM

    from quantlab.distill import chunked_head
    from quantlab.distill.chunked_head import heads_taken_out, kl_from_hidden_states, takes_chunked_head
    from quantlab.testing import tiny_llama

    monkeypatch.setattr(chunked_head, "CHUNK_BYTES", 4 * 256 * 5)  # 5 rows a chunk
    config = tiny_llama(0).config
    student = AutoModelForCausalLM.from_config(config.__class__(**{**config.to_dict(), "tie_word_embeddings": tied}))
    teacher = tiny_llama(1)
    student.get_output_embeddings().requires_grad_(head_trains)
    student.get_input_embeddings().requires_grad_(head_trains)
    assert takes_chunked_head(student, teacher)
    batch = torch.randint(0, 256, (2, 9))
    labels = batch.clone()
    labels[1, 6:] = IGNORE_INDEX
    with heads_taken_out(student, teacher) as (student_head, teacher_head):
        with torch.no_grad():
            teacher_hidden = teacher(input_ids=batch).logits
        student_hidden = student(input_ids=batch).logits
    assert student_hidden.shape == (2, 9, config.hidden_size)
    assert student.get_output_embeddings() is student_head
    kl, ce = kl_from_hidden_states(student_hidden, teacher_hidden, student_head, teacher_head, labels, 2.0)
    kl.backward()
    got = {n: p.grad.clone() for n, p in student.named_parameters() if p.requires_grad}
    student.zero_grad()
    expected_kl, expected_ce = kl_and_cross_entropy(student(input_ids=batch).logits, teacher(input_ids=batch).logits,
                                                    labels, 2.0)  # fmt: skip
    expected_kl.backward()
    assert torch.allclose(kl, expected_kl, rtol=1e-5) and torch.allclose(ce, expected_ce, rtol=1e-5)
    trained = [name for name, parameter in student.named_parameters() if parameter.requires_grad]
    assert ("lm_head.weight" in trained) == (head_trains and not tied)  # a tied head is the input table
    assert ("model.embed_tokens.weight" in trained) == head_trains
    for name, parameter in student.named_parameters():
        if parameter.requires_grad:
            assert torch.allclose(got[name], parameter.grad, rtol=1e-4, atol=1e-7), name
