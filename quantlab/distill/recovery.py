"""Recovery training after pruning: fine-tuning with the pruning masks held, or distillation from a teacher.

What `quantlab prune` runs when given training steps, once `quantlab.prune.pipeline` has pruned the model.
Distilling from the unpruned model recovers more than plain fine-tuning on the same text.
"""

from typing import Any

import torch
from torch import nn

from quantlab.distill.student import freeze_embeddings
from quantlab.distill.trainer import DistillationTrainer
from quantlab.prune.layer_masks import masked_layers
from quantlab.prune.schedule import KeepMasks
from quantlab.training.data import CausalLMCollator
from quantlab.training.trainer import Trainer


def recover(
    model: nn.Module,
    args: Any,
    train: Any,
    tokenizer: Any,
    *,
    eval_windows: torch.Tensor | None = None,
    teacher: nn.Module | None = None,
    teacher_tokenizer: Any = None,
    distillation: Any = None,
    resume_from_checkpoint: str | None = None,
) -> list[float]:
    """Train the pruned `model` in place (embeddings frozen, masks held) for `args.max_steps`, from `teacher` when
    given (`DistillationConfig` `distillation`); returns the logged losses. `args` are `TrainingArguments`."""
    model.train()
    freeze_embeddings(model)
    options = {"eval_windows": eval_windows, "data_collator": CausalLMCollator.for_tokenizer(tokenizer)}
    if teacher is None:
        callbacks = [KeepMasks()] if masked_layers(model) else []
        trainer = Trainer(model, args, train, callbacks=callbacks, save_final=False, **options)
    else:
        trainer = DistillationTrainer(
            model, teacher, args, train, distillation=distillation, teacher_tokenizer=teacher_tokenizer,
            student_tokenizer=tokenizer, save_final=False, **options,
        )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    model.eval()
    return [record["loss"] for record in trainer.state.log_history if "loss" in record]
