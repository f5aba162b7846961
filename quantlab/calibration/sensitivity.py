"""How much an error in each layer's output costs the model's loss: the empirical Fisher per layer.

To second order, adding an error `e_t` to a layer's output at token `t` raises that token's
loss by about `e_t^T F_t e_t / 2` with `F_t = g_t g_t^T`, `g_t` the gradient of the token's
loss with respect to the layer's output (the empirical Fisher, as in OBS/HAWQ-style mixed
precision). Taking `F` as a scalar per layer, `E_t ||g_t||^2 / out_features`, the loss a
quantized layer adds is that scalar times its output error `E ||x (W - Q)^T||^2`; summed over
layers it predicts the loss of a whole assignment, which is what mixed precision minimises.
One forward and backward pass of the float model over a few calibration windows measures it
(gradients for activations only: no parameter gradient is allocated).
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

WINDOWS = 16
BATCH_SIZE = 2  # the logits of a batch and their gradient: 2 x 256 x 49152 floats x 3 for SmolLM2


def output_fisher(
    model: nn.Module, windows: torch.Tensor, names: list[str], max_windows: int = WINDOWS
) -> dict[str, float] | None:
    """`E_t ||dloss_t/dy_t||^2 / out_features` for each named Linear layer, or None when the
    model computes no language-modelling loss (encoders): then no Fisher is known."""
    sums = dict.fromkeys(names, 0.0)
    tokens = 0
    frozen = [p for p in model.parameters() if p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(False)
    handles = [model.get_input_embeddings().register_forward_hook(_track_gradients)]
    handles += [model.get_submodule(name).register_forward_hook(_gradient_probe(name, sums)) for name in names]
    try:
        with torch.enable_grad():
            for batch in windows[:max_windows].split(BATCH_SIZE):
                output = model(input_ids=batch, labels=batch, use_cache=False)
                if getattr(output, "loss", None) is None:
                    return None
                predicted = batch.shape[0] * (batch.shape[1] - 1)
                (output.loss * predicted).backward()  # summed over tokens: g_t is each token's own gradient
                tokens += predicted
    except (TypeError, ValueError):
        return None  # no `labels` argument: not a language model
    finally:
        for handle in handles:
            handle.remove()
        for parameter in frozen:
            parameter.requires_grad_(True)
    return {name: total / tokens for name, total in sums.items()}


def _track_gradients(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output.detach().requires_grad_(True)


def _gradient_probe(name: str, sums: dict[str, float]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(lambda grad: _add(sums, name, grad))

    return hook


def _add(sums: dict[str, float], name: str, grad: torch.Tensor) -> None:
    sums[name] += float(grad.detach().float().square().sum()) / grad.shape[-1]
