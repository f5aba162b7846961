"""`causal_lm_loss` against transformers' `ForCausalLMLoss`: same loss, same gradient."""

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from quantlab.integrations import chunked_loss as losses
from quantlab.integrations.chunked_loss import causal_lm_loss

VOCAB = 37


def _inputs(batch: int, length: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 100 + length)
    logits = (torch.randn(batch, length, VOCAB, generator=generator) * 4).to(dtype)
    labels = torch.randint(0, VOCAB, (batch, length), generator=generator)
    labels[0, :3] = -100  # padding / prompt positions
    labels[-1, -2] = -100
    return logits, labels


def _loss_and_grad(function, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.clone().requires_grad_()
    loss = function(leaf, labels, VOCAB, **kwargs)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.fixture(params=[1, 3, 64], ids=["rows1", "rows3", "rows64"])
def chunk_rows(request, monkeypatch) -> int:
    monkeypatch.setattr(losses, "CHUNK_BYTES", 4 * VOCAB * request.param)
    return request.param


@pytest.mark.parametrize("num_items", [None, 29, torch.tensor(31)], ids=["mean", "int", "tensor"])
@pytest.mark.parametrize(("batch", "length"), [(3, 7), (2, 11), (1, 5)])
def test_matches_transformers_loss_and_gradient(chunk_rows, batch, length, num_items):
    logits, labels = _inputs(batch, length)  # 21 and 22 rows: no chunk size here divides them
    expected_loss, expected_grad = _loss_and_grad(ForCausalLMLoss, logits, labels, num_items_in_batch=num_items)
    loss, grad = _loss_and_grad(causal_lm_loss, logits, labels, num_items_in_batch=num_items)
    assert loss.dtype == expected_loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-8)
    assert not grad[0, :2].any()  # rows whose next label is ignored get no gradient


def test_shift_labels_given_and_bfloat16_logits(chunk_rows):
    logits, labels = _inputs(2, 9, torch.bfloat16)
    shifted = labels.roll(-1, dims=1)
    expected_loss, expected_grad = _loss_and_grad(ForCausalLMLoss, logits, None, shift_labels=shifted)
    loss, grad = _loss_and_grad(causal_lm_loss, logits, None, shift_labels=shifted)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=2**-8, atol=0)  # float32 values rounded once to bfloat16


def test_without_autograd_the_loss_is_the_same_and_nothing_is_kept():
    logits, labels = _inputs(3, 7)
    with torch.no_grad():
        loss = causal_lm_loss(logits.requires_grad_(), labels, VOCAB)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, ForCausalLMLoss(logits.detach(), labels, VOCAB), rtol=1e-6, atol=0)


def test_scaled_loss_retained_graph_and_untouched_logits():
    logits, labels = _inputs(3, 7)
    leaf = logits.clone().requires_grad_()
    loss = causal_lm_loss(leaf, labels, VOCAB)
    (loss * 3).backward(retain_graph=True)
    loss.backward()  # the saved gradient survives the first backward and is not scaled in place
    reference = logits.clone().requires_grad_()
    ForCausalLMLoss(reference, labels, VOCAB).backward()
    torch.testing.assert_close(leaf.grad, 4 * reference.grad, rtol=1e-5, atol=1e-8)
    assert torch.equal(leaf.detach(), logits)


def test_every_label_ignored_gives_nan_loss_and_zero_gradient_as_transformers():
    logits, labels = _inputs(2, 5)
    labels[:] = -100
    expected_loss, expected_grad = _loss_and_grad(ForCausalLMLoss, logits, labels)
    loss, grad = _loss_and_grad(causal_lm_loss, logits, labels)
    assert expected_loss.isnan() and loss.isnan()
    assert torch.equal(grad, expected_grad)
