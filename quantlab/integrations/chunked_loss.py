"""Causal-LM cross-entropy whose training step holds two logits-sized tensors at its peak, not three.

transformers' `ForCausalLMLoss` calls `cross_entropy` on the whole `[tokens, vocabulary]`
logits: autograd keeps the log-softmax (one logits-sized tensor) for backward, which then
allocates the log-softmax's gradient and the logits' gradient (two more, alive together). On
SmolLM2 (vocabulary 49,152) at batch 4 x 256 each is 192 MiB in float32, and these three are the
peak of a QLoRA step. `causal_lm_loss` gives the same loss and gradient (to float rounding) but
works over chunks of rows and computes the logits' gradient in the forward pass, chunk by chunk:
it keeps only that gradient (in the logits' dtype), recomputes nothing in backward and hands it
on without a copy, so the peak is the logits and their gradient. Without autograd (evaluation)
it keeps nothing. The logits are never modified.

`use_chunked_loss(model)` makes it a transformers model's `loss_function`; the quantizer does
so for every model it loads, and `quantlab.quantize` for every model it converts.
"""

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional

from quantlab.utils.environment import switched_on

CHUNK_BYTES = 16 * 1024 * 1024  # float32 bytes per chunk of rows: large enough to keep both cores busy


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """Drop-in for `transformers.loss.loss_utils.ForCausalLMLoss` (same arguments, same result).

    Mean over the positions whose label is not `ignore_index`, or their sum divided by
    `num_items_in_batch` when it is given (transformers' gradient-accumulation convention).
    """
    if shift_labels is None:
        labels = functional.pad(labels, (0, 1), value=ignore_index)  # tokens < n predict n
        shift_labels = labels[..., 1:]
    rows = logits.reshape(-1, vocab_size)
    targets = shift_labels.reshape(-1).to(rows.device)
    if num_items_in_batch is None:
        denominator = (targets != ignore_index).sum()
    elif torch.is_tensor(num_items_in_batch):
        denominator = num_items_in_batch.to(rows.device)
    else:
        denominator = torch.tensor(num_items_in_batch, device=rows.device)
    if torch.is_grad_enabled() and rows.requires_grad:
        return _ChunkedCrossEntropy.apply(rows, targets, denominator, ignore_index)
    total, _ = _chunked_cross_entropy(rows, targets, denominator, ignore_index, with_gradient=False)
    return total / denominator


def use_chunked_loss(model: torch.nn.Module) -> bool:
    """Give `model` quantlab's chunked causal-LM cross-entropy if its loss is transformers' `ForCausalLMLoss`.

    Exact (the same loss and gradients to float rounding), so it is on for every quantlab model;
    `QUANTLAB_CHUNKED_LOSS=0` turns it off, as does `model.loss_function = ForCausalLMLoss` later.
    A model whose class or user chose another loss keeps it. Returns whether it was installed.
    """
    # transformers' model code is heavy to import; by the time a model is here it is loaded anyway
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    if not switched_on("QUANTLAB_CHUNKED_LOSS"):
        return False
    if not isinstance(model, PreTrainedModel) or "_loss_function" in vars(model):
        return False
    if type(model).loss_function is not PreTrainedModel.loss_function:  # a model class with a loss of its own
        return False
    if LOSS_MAPPING.get(getattr(model, "loss_type", None)) is not ForCausalLMLoss:
        return False
    model.loss_function = causal_lm_loss
    return True


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of the rows' cross-entropy over `denominator`; the gradient is made in forward."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        rows: torch.Tensor,
        targets: torch.Tensor,
        denominator: torch.Tensor,
        ignore_index: int,
    ) -> torch.Tensor:
        total, gradient = _chunked_cross_entropy(rows, targets, denominator, ignore_index, with_gradient=True)
        ctx.save_for_backward(gradient)  # saved tensors, unlike ctx attributes, are freed once backward ran
        return total / denominator

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor) -> tuple:
        (gradient,) = ctx.saved_tensors
        if grad_output.item() != 1:  # a scaled loss; 1 (the usual case) hands the saved gradient on, no copy
            gradient = gradient * grad_output.to(gradient.dtype)
        return gradient, None, None, None


def _chunked_cross_entropy(
    rows: torch.Tensor, targets: torch.Tensor, denominator: torch.Tensor, ignore_index: int, with_gradient: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The summed loss (float32) and, if asked, d(sum / denominator)/d(rows) in the rows' dtype."""
    chunk = max(1, CHUNK_BYTES // (4 * rows.shape[-1]))
    gradient = torch.empty_like(rows) if with_gradient else None
    weight = 1.0 / denominator.to(torch.float32)  # as cross_entropy's backward scales: grad / total
    total = torch.zeros((), dtype=torch.float32, device=rows.device)
    with torch.no_grad():
        for start in range(0, rows.shape[0], chunk):
            x = rows[start : start + chunk]
            target = targets[start : start + chunk]
            valid = target != ignore_index
            index = target.where(valid, 0).unsqueeze(1)
            highest = x.amax(dim=-1, keepdim=True).float()
            in_place = gradient is not None and gradient.dtype == torch.float32
            if in_place:  # the exponentials go straight into the chunk's gradient rows: no scratch
                exp = torch.sub(x, highest, out=gradient[start : start + chunk]).exp_()
            else:
                exp = (x.float() - highest).exp_()
            norm = exp.sum(dim=-1, keepdim=True)
            log_norm = highest + norm.log()
            picked = x.gather(1, index).float()
            total += ((log_norm - picked).squeeze(1) * valid).sum()
            if gradient is not None:
                scale = torch.where(valid, weight, 0.0).unsqueeze(1)  # 0 on ignored rows, even if weight is inf
                exp.mul_(scale / norm)  # softmax / denominator
                exp.scatter_add_(1, index, -scale)  # minus the one-hot target
                if not in_place:
                    gradient[start : start + chunk] = exp
    return total, gradient
