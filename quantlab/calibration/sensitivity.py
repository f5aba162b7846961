"""How much an error in each layer's output costs the model's loss: the empirical Fisher per layer.

To second order, adding an error `e_t` to a layer's output at token `t` raises that token's
loss by about `e_t^T F_t e_t / 2` with `F_t = g_t g_t^T`, `g_t` the gradient of the token's
loss with respect to the layer's output (the empirical Fisher, as in OBS/HAWQ-style mixed
precision). Taking `F` as a scalar per layer, `E_t ||g_t||^2 / out_features`, the loss a
quantized layer adds is that scalar times its output error `E ||x (W - Q)^T||^2`; summed over
layers it predicts the loss of a whole assignment, which is what mixed precision minimises.
One forward and backward pass of the float model over a few calibration windows measures it
(gradients for activations only: no parameter gradient is allocated).

An expert's slice of a fused experts projection (`{experts}.{projection}.{expert}`) is probed at
its own output, on the tokens routed to it (`quantlab.calibration.experts.slice_hooks`): the
gradient there already carries the routing weight, and a token routed elsewhere adds nothing, so
its value is `sum_{t routed} ||g_t||^2 / out_features` over all tokens, the expert's mean Fisher
times its share of the tokens.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quantlab import distributed
from quantlab.calibration.experts import expert_slice, slice_hooks

WINDOWS = 16
BATCH_SIZE = 2  # the logits of a batch and their gradient: 2 x 256 x 49152 floats x 3 for SmolLM2


def output_fisher(
    model: nn.Module, windows: torch.Tensor, names: list[str], max_windows: int = WINDOWS
) -> dict[str, float] | None:
    """`E_t ||dloss_t/dy_t||^2 / out_features` for each named Linear layer, or None when the
    model computes no language-modelling loss (encoders): then no Fisher is known.

    Processes calibrating together each take a share of the batches; the per-batch sums are
    gathered and added in batch order, so every process gets the one-process values."""
    batches = windows[:max_windows].split(BATCH_SIZE)
    mine = distributed.batch_share(len(batches))
    sums = torch.zeros(len(mine), len(names) + 1, dtype=torch.float64)  # per batch: each layer's sum, tokens
    frozen = [p for p in model.parameters() if p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(False)
    handles = [model.get_input_embeddings().register_forward_hook(_track_gradients)]
    has_loss = True
    try:
        with torch.enable_grad():
            for row, index in enumerate(mine):
                batch = batches[index]
                probes = _register_probes(model, names, sums[row])
                try:
                    output = model(input_ids=batch, labels=batch, use_cache=False)
                    if getattr(output, "loss", None) is None:
                        has_loss = False
                        break
                    predicted = batch.shape[0] * (batch.shape[1] - 1)
                    (output.loss * predicted).backward()  # summed over tokens: g_t is each token's own gradient
                    sums[row, -1] = predicted
                finally:
                    for probe in probes:
                        probe.remove()
    except (TypeError, ValueError):
        has_loss = False  # no `labels` argument: not a language model
    finally:
        for handle in handles:
            handle.remove()
        for parameter in frozen:
            parameter.requires_grad_(True)
    if distributed.any_rank(not has_loss):
        return None
    totals = distributed.sum_rows_in_order(sums)
    return {name: float(totals[column] / totals[-1]) for column, name in enumerate(names)}


def _register_probes(model: nn.Module, names: list[str], sums: torch.Tensor) -> list[Any]:
    """A gradient probe on each named Linear layer or expert slice, adding to its column of `sums`; each
    returned handle's `remove` takes its probes away."""
    layers, slices = {}, {}
    for column, name in enumerate(names):
        probes = slices if expert_slice(model, name) is not None else layers
        probes[name] = _gradient_probe(sums, column)
    handles: list[Any] = [model.get_submodule(name).register_forward_hook(probe) for name, probe in layers.items()]
    return handles + slice_hooks(model, slices)


def _track_gradients(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output.detach().requires_grad_(True)


def _gradient_probe(sums: torch.Tensor, column: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(lambda grad: _add(sums, column, grad))

    return hook


def _add(sums: torch.Tensor, column: int, grad: torch.Tensor) -> None:
    sums[column] += float(grad.detach().float().square().sum()) / grad.shape[-1]
