"""Distillation as a `compute_loss` override of quantlab's `Trainer` (itself `transformers.Trainer`).

`DistillationTrainer` checks that teacher and student share a vocabulary, freezes the teacher and
computes `DistillationLoss` for each micro-batch. When hidden states are matched, the projection
that maps the student's onto the teacher's trains with the student: both sit in one module
(`DistillationModel`) so the optimizer, DDP and checkpoints take them together; the trained
student alone is what `output_dir/final` holds. A pruned student gets `KeepMasks`, so its
sparsity holds. TRL's `DistillationTrainer` (trl 1.16) does not fit: it trains on-policy, the
student generating completions for the prompts of a (chat) dataset at every step, where this
distills on plain text with teacher forcing, which on CPU costs one forward of each model.
An encoder student is matched on its last hidden states (`EncoderDistillationLoss`).
"""

from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantlab.distill.compat import check_vocabularies
from quantlab.distill.config import DistillationConfig
from quantlab.distill.hidden import HiddenStateProjection
from quantlab.distill.loss import HIDDEN_PROJECTION, TEACHER, distillation_loss
from quantlab.errors import QuantlabError
from quantlab.prune.layer_masks import masked_layers
from quantlab.prune.schedule import KeepMasks
from quantlab.training.trainer import Trainer


class DistillationModel(nn.Module):
    """The student and the projection of its hidden states (None without hidden matching); runs the student."""

    def __init__(self, student: nn.Module, projection: nn.Module | None) -> None:
        super().__init__()
        self.student, self.projection = student, projection

    def forward(self, **inputs: Any) -> Any:
        return self.student(**inputs)

    @property
    def config(self) -> Any:
        return getattr(self.student, "config", None)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, **options: Any):
        """Activation checkpointing of the student (what `Trainer` calls with `activation_checkpointing`);
        non-reentrant by default, which needs no input that requires a gradient (the student's embeddings
        are frozen)."""
        kwargs = {"use_reentrant": False, **(activation_checkpointing_kwargs or {})}
        return self.student.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **options)

    @property
    def peft_config(self) -> Any:
        return getattr(self.student, "peft_config", None)


class DistillationTrainer(Trainer):
    """Trains `student` to match `teacher` (float or quantized); the student trains what it has trainable."""

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        args: Any,
        train_dataset: Any = None,
        *,
        distillation: DistillationConfig | None = None,
        teacher_tokenizer: Any = None,
        student_tokenizer: Any = None,
        callbacks: list | None = None,
        **kwargs: Any,
    ) -> None:
        self.distillation = distillation or DistillationConfig()
        if teacher is student:
            raise QuantlabError("the teacher and the student are the same model object; load the teacher separately")
        check_vocabularies(teacher, student, teacher_tokenizer, student_tokenizer)
        teacher.requires_grad_(False)
        projection = None
        if self.distillation.matches_hidden_states:
            pairs = len(self.distillation.layer_pairs)
            projection = HiddenStateProjection(_hidden_size(student), _hidden_size(teacher), pairs=pairs)
        callbacks = list(callbacks or [])
        if masked_layers(student) and not any(isinstance(c, KeepMasks) for c in callbacks):
            callbacks.append(KeepMasks())
        self.loss = distillation_loss(student, self.distillation)
        self._metric_sums: dict[str, torch.Tensor] = {}
        self._metric_steps = 0
        super().__init__(DistillationModel(student, projection), args, train_dataset, callbacks=callbacks, **kwargs)
        self.model_accepts_loss_kwargs = True  # the loss is normalized by num_items_in_batch
        self.extra_modules = {TEACHER: teacher.to(self.args.device).eval(), HIDDEN_PROJECTION: projection}

    def _set_signature_columns_if_needed(self) -> None:
        self._signature_columns = ["input_ids", "attention_mask", "labels"]  # the student's; the wrapper takes **inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        num_items = num_items_in_batch if num_items_in_batch is not None else self.loss.count_items(inputs)
        output = self.loss(self, model, inputs, num_items)  # the student through `model`, so DDP syncs it
        for key, value in output.metrics.items():
            self._metric_sums[key] = self._metric_sums.get(key, 0) + value.detach().double()
        loss = output.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients; num_items counts every process
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the loss terms (`kl`, `ce`, `hidden_mse`), token means over the steps since the last log."""
        if "loss" in logs and self._metric_sums:
            steps = max(1, self.state.global_step - self._metric_steps)
            names = list(self._metric_sums)
            summed = torch.stack([self._metric_sums[n] for n in names]).to(self.args.device)
            if self.accelerator.num_processes > 1:
                summed = self.accelerator.reduce(summed, reduction="sum")
            logs.update({name: float(value) / steps for name, value in zip(names, summed, strict=True)})
            self._metric_sums, self._metric_steps = {}, self.state.global_step
        super().log(logs, start_time)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The student alone, as `save_pretrained` writes it (the projection only serves training)."""
        if self.args.should_save:
            student = self.accelerator.unwrap_model(self.model).student
            student.save_pretrained(Path(output_dir or self.args.output_dir))
            (Path(output_dir or self.args.output_dir) / "training_args.json").write_text(self.args.to_json_string())


def distillation_trainer(student: nn.Module, teacher: nn.Module, args: Any, train_dataset: Any = None, **kwargs: Any):
    """`DistillationTrainer(student, teacher, args, train_dataset, **kwargs)`."""
    return DistillationTrainer(student, teacher, args, train_dataset, **kwargs)


def _hidden_size(model: nn.Module) -> int:
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    if not isinstance(size, int):
        raise QuantlabError(f"hidden-state matching needs config.hidden_size, which {type(model).__name__} lacks")
    return size
