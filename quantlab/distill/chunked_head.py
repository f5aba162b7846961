"""The distillation KL from the models' last hidden states, the output head applied a chunk of rows at a time.

A causal LM's logits are `[tokens, vocabulary]`: at SmolLM2's 49,152 entries and 4 x 256 tokens, 192 MiB
each for the teacher, the student and the student's gradient, the largest tensors of a quantization-aware
training step on a small model. Neither model needs its whole logits: both run with their head taken out
(`heads_taken_out`: the model returns its last hidden state where the logits were), and
`kl_from_hidden_states` applies each head to a chunk of rows, sums the chunk's KL and cross-entropy, and
backpropagates the chunk's gradient through the student's head at once. What is kept for the backward
pass is the gradient of the student's hidden states, `[tokens, hidden]`, and, where the student's head
trains (a float head trained with the embedding table it is tied to), its parameters' gradients summed
over the chunks.

Only for architectures whose logits are their head's output and nothing more (`PLAIN_HEAD_MODELS`); a
model that caps or scales its logits (Gemma 2, Granite, Cohere) keeps the whole-logits path.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from quantlab.distill.chunked_kl import KLGradientMadeInForward
from quantlab.training.data import IGNORE_INDEX

CHUNK_BYTES = 32 * 1024 * 1024  # float32 bytes of one chunk's logits (a 16-bit head is cast once a chunk)
PLAIN_HEAD_MODELS = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "phi3", "olmo2", "smollm3"}
)


def takes_chunked_head(student: nn.Module, teacher: nn.Module) -> bool:
    """Whether both models' logits are their head's output alone."""
    for model in (student, teacher):
        config = getattr(model, "config", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if getattr(config, "model_type", None) not in PLAIN_HEAD_MODELS or head is None:
            return False
    return True


class _HiddenStatesOut(nn.Module):
    """Stands where the output head was: the model's 'logits' are then its last hidden states."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


@contextlib.contextmanager
def heads_taken_out(*models: nn.Module) -> Iterator[list[nn.Module]]:
    """Inside, each model returns its last hidden states as `logits`; yields the heads taken out."""
    heads = [model.get_output_embeddings() for model in models]
    for model in models:
        model.set_output_embeddings(_HiddenStatesOut())
    try:
        yield heads
    finally:
        for model, head in zip(models, heads, strict=True):
            model.set_output_embeddings(head)


def kl_from_hidden_states(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_head: nn.Module,
    teacher_head: nn.Module,
    labels: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over the positions that predict a label of the next-token KL (differentiable in `student_hidden`
    and in the student head's trained parameters) and of the student's cross-entropy (no gradient); hidden
    states `[batch, positions, hidden]`."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    student_rows = student_hidden.reshape(-1, student_hidden.shape[-1])
    teacher_rows = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    heads = (student_head, teacher_head)
    trained = [parameter for parameter in student_head.parameters() if parameter.requires_grad]

    def compute(with_gradient: bool) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        return _chunked(student_rows, teacher_rows, targets, temperature, heads, trained if with_gradient else None)

    if torch.is_grad_enabled() and (student_rows.requires_grad or trained):
        return KLGradientMadeInForward.apply(student_rows, compute, *trained)
    kl, ce, _ = compute(False)
    return kl, ce


def _chunked(
    student_rows: torch.Tensor,
    teacher_rows: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    heads: tuple[nn.Module, nn.Module],
    trained: list[nn.Parameter] | None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The chunks' KL and cross-entropy sums; with `trained` (the student head's trained parameters, maybe
    none) also the KL's gradients: in the rows, then in each of `trained`."""
    student_head, teacher_head = heads
    vocabulary = _vocabulary(student_head)
    chunk = max(1, CHUNK_BYTES // (4 * vocabulary))
    with_gradient = trained is not None
    gradient = torch.zeros_like(student_rows) if with_gradient else None
    head_gradients = [torch.zeros_like(parameter) for parameter in trained or []]
    kl = torch.zeros((), dtype=torch.float32, device=student_rows.device)
    ce = torch.zeros((), dtype=torch.float32, device=student_rows.device)
    for start in range(0, student_rows.shape[0], chunk):
        target = targets[start : start + chunk]
        rows = (target != IGNORE_INDEX).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        with torch.no_grad():
            teacher_logits = teacher_head(teacher_rows[start : start + chunk][rows]).float()
            teacher_log = F.log_softmax(teacher_logits / temperature, dim=-1)
        hidden = student_rows[start : start + chunk][rows].detach().requires_grad_(with_gradient)
        with torch.set_grad_enabled(with_gradient):
            logits = student_head(hidden)
        with torch.no_grad():
            student = logits.detach().float()
            student_log = F.log_softmax(student / temperature, dim=-1)
            kl += (teacher_log.exp() * (teacher_log - student_log)).sum()
            plain_log = student_log if temperature == 1.0 else F.log_softmax(student, dim=-1)
            ce -= plain_log.gather(1, target[rows].unsqueeze(1)).sum()
            step = (student_log.exp_() - teacher_log.exp_()) / temperature
        if gradient is not None:
            inputs = [hidden, *(trained or [])]
            hidden_gradient, *parts = torch.autograd.grad(logits, inputs, step.to(logits.dtype), allow_unused=True)
            gradient[start : start + chunk][rows] = hidden_gradient.to(gradient.dtype)
            for total, part in zip(head_gradients, parts, strict=True):
                if part is not None:
                    total += part
    return kl, ce, () if gradient is None else (gradient, *head_gradients)


def _vocabulary(head: nn.Module) -> int:
    size = getattr(head, "out_features", None) or getattr(getattr(head, "weight", None), "shape", [0])[0]
    return int(size) or 1
