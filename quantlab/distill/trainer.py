"""Distillation on the shared training loop: a `Trainer` whose loss reads a frozen teacher.

Nothing here is a second loop: `distillation_trainer` checks that teacher and student share a
vocabulary, freezes the teacher, and hands the loop the `DistillationLoss`, the teacher (and
the hidden-state projection, which trains) as extra modules, and `KeepMasks` when the student
is pruned, so its sparsity holds. Accumulation, mixed precision, checkpoints and resume are
the loop's.
"""

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from quantlab.distill.compat import check_vocabularies
from quantlab.distill.config import DistillationConfig
from quantlab.distill.hidden import HiddenStateProjection
from quantlab.distill.loss import HIDDEN_PROJECTION, TEACHER, DistillationLoss
from quantlab.errors import QuantlabError
from quantlab.prune.masking import masked_layers
from quantlab.prune.schedule import KeepMasks
from quantlab.training.callbacks import Callback
from quantlab.training.config import TrainingConfig
from quantlab.training.trainer import Trainer


def distillation_trainer(
    student: nn.Module,
    teacher: nn.Module,
    config: TrainingConfig,
    train_data: Dataset,
    *,
    distillation: DistillationConfig | None = None,
    eval_windows: torch.Tensor | None = None,
    collator: Any = None,
    callbacks: list[Callback] | tuple[Callback, ...] = (),
    teacher_tokenizer: Any = None,
    student_tokenizer: Any = None,
) -> Trainer:
    """A `Trainer` that distills `teacher` (float or quantized) into `student` (float, pruned, quantized + LoRA).

    The student trains what it has trainable (all weights, or its LoRA adapters). Tokenizers,
    when given, must be identical; the logits' widths must match in any case.
    """
    distillation = distillation or DistillationConfig()
    if teacher is student:
        raise QuantlabError("the teacher and the student are the same model object; load the teacher separately")
    check_vocabularies(teacher, student, teacher_tokenizer, student_tokenizer)
    teacher.requires_grad_(False)
    extra_modules: dict[str, nn.Module] = {TEACHER: teacher}
    if distillation.matches_hidden_states:
        extra_modules[HIDDEN_PROJECTION] = HiddenStateProjection(
            _hidden_size(student), _hidden_size(teacher), pairs=len(distillation.layer_pairs)
        )
    callbacks = list(callbacks)
    if masked_layers(student) and not any(isinstance(c, KeepMasks) for c in callbacks):
        callbacks.append(KeepMasks())
    return Trainer(
        student,
        config,
        train_data,
        eval_windows=eval_windows,
        collator=collator,
        loss=DistillationLoss(distillation),
        callbacks=callbacks,
        extra_modules=extra_modules,
    )


def _hidden_size(model: nn.Module) -> int:
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    if not isinstance(size, int):
        raise QuantlabError(f"hidden-state matching needs config.hidden_size, which {type(model).__name__} lacks")
    return size
