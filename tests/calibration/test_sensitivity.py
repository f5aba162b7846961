"""The per-layer empirical Fisher that weighs mixed precision's error predictions."""

import torch

from quantlab.calibration.sensitivity import output_fisher
from quantlab.testing.models import tiny_bert, tiny_llama

WINDOWS = torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(0))
LAYERS = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"]


def test_fisher_matches_per_token_gradients_and_leaves_the_parameters_alone():
    model = tiny_llama()
    fisher = output_fisher(model, WINDOWS, LAYERS)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())

    # The definition, one window at a time: each token's loss gradient at the layer output, squared.
    layer = model.get_submodule(LAYERS[1])
    total, tokens = 0.0, 0
    for window in WINDOWS:
        captured = []
        handle = layer.register_forward_hook(lambda m, a, out: captured.append(out))
        logits = model(window[None]).logits[0, :-1]
        handle.remove()
        losses = torch.nn.functional.cross_entropy(logits, window[1:], reduction="none")
        (grad,) = torch.autograd.grad(losses.sum(), captured[0])
        total += float(grad[0, :-1].square().sum()) / grad.shape[-1]  # the last position predicts nothing
        tokens += len(losses)
    assert abs(fisher[LAYERS[1]] - total / tokens) <= 1e-4 * total / tokens
    assert all(value > 0 for value in fisher.values())


def test_an_encoder_without_a_loss_has_no_fisher():
    model = tiny_bert()
    assert output_fisher(model, WINDOWS, ["encoder.layer.0.attention.self.query"]) is None
    assert all(p.requires_grad for p in model.parameters())
