"""Held-out perplexity during training, with the formula of the shared harness.

Each window `x` of `[windows, seq_len]` is scored as `model(x, labels=x)`, and perplexity is
`exp(sum(loss_i * (seq_len - 1)) / (windows * (seq_len - 1)))`, as in
`quantlab.eval.perplexity`. Under several processes each scores every n-th window and the
sums are added, so the figure does not depend on the number of processes.
"""

import math

import torch
from torch import nn


def heldout_perplexity(model: nn.Module, windows: torch.Tensor, accelerator=None) -> float:
    """Perplexity of `model` on `windows` (token ids `[windows, seq_len]`), in eval mode, without gradients."""
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    predicted = windows.shape[1] - 1
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed token loss, windows scored
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for row in windows[rank::world]:
                x = row.unsqueeze(0).to(device)
                total[0] += float(model(input_ids=x, labels=x).loss) * predicted
                total[1] += 1
    finally:
        model.train(was_training)
    if world > 1:
        total = accelerator.reduce(total, reduction="sum")
    return math.exp(float(total[0]) / (float(total[1]) * predicted))
