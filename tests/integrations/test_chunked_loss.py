"""Quantized causal LMs train with quantlab's chunked `causal_lm_loss`, installed by the quantizer."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

import quantlab
from quantlab.integrations.chunked_loss import causal_lm_loss, use_chunked_loss
from quantlab.testing import tiny_bert, tiny_llama, tiny_llama_checkpoint

IDS = torch.arange(48).reshape(2, 24) * 11 % 256


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("float") / "tiny")


def _loss_and_head_grad(model: torch.nn.Module, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad()
    model.lm_head.weight.requires_grad_(True)
    loss = model(input_ids=IDS, labels=labels).loss
    loss.backward()
    return loss.detach(), model.lm_head.weight.grad.clone()


def test_from_pretrained_installs_it_and_training_matches_transformers_loss(float_dir):
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=quantlab.NF4Config())
    assert model.loss_function is causal_lm_loss
    labels = IDS.clone()
    labels[:, :5] = -100
    loss, grad = _loss_and_head_grad(model, labels)
    model.loss_function = ForCausalLMLoss  # the documented way back
    expected_loss, expected_grad = _loss_and_head_grad(model, labels)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_evaluation_without_labels_is_untouched(float_dir):
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=quantlab.NF4Config())
    with torch.no_grad():
        chunked = model(input_ids=IDS)
        model.loss_function = ForCausalLMLoss
        plain = model(input_ids=IDS)
    assert chunked.loss is None and plain.loss is None
    assert torch.equal(chunked.logits, plain.logits)


def test_save_and_reload_are_unaffected(float_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=quantlab.NF4Config())
    model.save_pretrained(tmp_path / "nf4")
    assert "loss" not in json.dumps(json.loads((tmp_path / "nf4" / "config.json").read_text()))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "nf4")
    assert reloaded.loss_function is causal_lm_loss
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=IDS).logits, model(input_ids=IDS).logits)
        torch.testing.assert_close(reloaded(input_ids=IDS, labels=IDS).loss, model(input_ids=IDS, labels=IDS).loss)


def test_quantize_in_memory_installs_it_too():
    assert quantlab.quantize(tiny_llama(), quantlab.Int8SymmetricConfig()).loss_function is causal_lm_loss


def test_environment_variable_turns_it_off(float_dir, monkeypatch):
    monkeypatch.setenv("QUANTLAB_CHUNKED_LOSS", "0")
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=quantlab.NF4Config())
    assert model.loss_function is ForCausalLMLoss


def test_other_losses_are_kept():
    encoder = tiny_bert()  # no causal-LM loss
    assert not use_chunked_loss(encoder) and "_loss_function" not in vars(encoder)
    model = tiny_llama()

    def own_loss(*args, **kwargs):
        return ForCausalLMLoss(*args, **kwargs)

    model.loss_function = own_loss  # a user's choice stays
    assert not use_chunked_loss(model) and model.loss_function is own_loss
