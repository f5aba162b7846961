"""The distillation KL summed over chunks of rows, its gradient made in the forward pass.

`KL(softmax(t / T) || softmax(s / T))` written with `log_softmax` and `kl_div` keeps, for backward,
the student's log-probabilities and builds the KL's elementwise terms, each as large as the logits
(`[tokens, vocabulary]`: 192 MiB on SmolLM2 at 4 x 256 tokens), then the backward pass allocates
as many again. Here each chunk's gradient, `(softmax(s / T) - softmax(t / T)) / T` on the scored
rows, is written into one logits-sized tensor while the chunk's terms are summed, so a step holds the
teacher's logits, the student's and that gradient, no more. The student's cross-entropy on the
labels comes from the same chunks (without a gradient) for the log.
"""

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from quantlab.training.data import IGNORE_INDEX

CHUNK_BYTES = 16 * 1024 * 1024  # float32 bytes of one chunk of rows


def kl_and_cross_entropy(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over the positions that predict a label (`labels[:, 1:]` not ignored) of the next-token KL
    (differentiable in `student_logits`) and of the student's cross-entropy (no gradient).

    `student_logits` and `teacher_logits`: `[batch, positions, vocabulary]`; `labels`: `[batch, positions]`."""
    vocabulary = student_logits.shape[-1]
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)  # position t predicts label t + 1
    student_rows = student_logits.reshape(-1, vocabulary)
    teacher_rows = teacher_logits.detach().reshape(-1, vocabulary)

    def compute(with_gradient: bool) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        kl, ce, gradient = _chunked(student_rows, teacher_rows, targets, temperature, with_gradient)
        return kl, ce, () if gradient is None else (gradient,)

    if torch.is_grad_enabled() and student_rows.requires_grad:
        return KLGradientMadeInForward.apply(student_rows, compute)
    kl, ce, _ = compute(False)
    return kl, ce


class KLGradientMadeInForward(torch.autograd.Function):
    """The sums `(kl, ce)` that `compute(True)` returns with the KL's gradients it made as it went, one for
    `rows` and one for each of `parameters` (a trained output head's, `quantlab.distill.chunked_head`);
    backward hands them on (scaled by the KL's own, when not 1). `ce` has no gradient."""

    @staticmethod
    def forward(ctx, rows, compute, *parameters):
        kl, ce, gradients = compute(True)
        ctx.save_for_backward(*gradients)
        ctx.mark_non_differentiable(ce)
        return kl, ce

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kl, grad_ce):
        gradients = list(ctx.saved_tensors)
        if grad_kl.item() != 1:
            gradients = [gradient * grad_kl.to(gradient.dtype) for gradient in gradients]
        return gradients[0], None, *gradients[1:]


def _chunked(
    student_rows: torch.Tensor, teacher_rows: torch.Tensor, targets: torch.Tensor, temperature: float,
    with_gradient: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    chunk = max(1, CHUNK_BYTES // (4 * student_rows.shape[-1]))
    gradient = torch.zeros_like(student_rows) if with_gradient else None
    kl = torch.zeros((), dtype=torch.float32, device=student_rows.device)
    ce = torch.zeros((), dtype=torch.float32, device=student_rows.device)
    with torch.no_grad():
        for start in range(0, student_rows.shape[0], chunk):
            target = targets[start : start + chunk]
            scored = target != IGNORE_INDEX
            if not bool(scored.any()):
                continue
            rows = scored.nonzero().squeeze(1)
            student = student_rows[start : start + chunk].float()
            teacher_log = F.log_softmax(teacher_rows[start : start + chunk].float() / temperature, dim=-1)
            student_log = F.log_softmax(student / temperature, dim=-1)
            terms = teacher_log.exp() * (teacher_log - student_log)
            kl += terms.sum(dim=-1)[rows].sum()
            plain_log = student_log if temperature == 1.0 else F.log_softmax(student, dim=-1)
            ce -= plain_log[rows, target[rows]].sum()
            if gradient is not None:
                step = (student_log.exp_() - teacher_log.exp_()) / temperature
                gradient[start : start + chunk][rows] = step[rows].to(gradient.dtype)
    return kl, ce, gradient
