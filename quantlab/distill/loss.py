"""The distillation loss that `DistillationTrainer.compute_loss` computes for each micro-batch.

Per micro-batch: the teacher (frozen, in eval mode) runs without
gradients; the student runs with its labels, giving the cross-entropy; the KL term compares
both next-token distributions at exactly the positions the cross-entropy scores (labels not
padding). Every term is a sum over those tokens divided by `num_items`, the token count of the
whole optimizer step (transformers' `num_items_in_batch`), so gradient accumulation and several
processes give the exact token mean. The terms are logged as `kl`, `ce` (and `hidden_mse`).

An encoder (no language-modelling head: a sentence-embedding model) has no next-token
distribution; `EncoderDistillationLoss` matches its last hidden states instead, by cosine
distance at every real token, the direction being what mean-pooled sentence embeddings keep, and
optionally (`embedding_weight`) the mean-pooled embeddings themselves, one term per example.
"""

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantlab.distill.chunked_head import heads_taken_out, kl_from_hidden_states, takes_chunked_head
from quantlab.distill.chunked_kl import kl_and_cross_entropy
from quantlab.distill.compat import VocabularyMismatchError
from quantlab.distill.config import DistillationConfig
from quantlab.distill.hidden import hidden_state_error
from quantlab.errors import ConfigError
from quantlab.eval.embeddings import mean_pooled
from quantlab.training.data import IGNORE_INDEX
from quantlab.utils.model_kind import is_language_model

TEACHER = "teacher"
HIDDEN_PROJECTION = "hidden_projection"


@dataclasses.dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def token_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """`KL(softmax(t/T) || softmax(s/T))` for each row of `[tokens, vocab]` logits, in float32: `[tokens]`."""
    teacher_log_probs = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    student_log_probs = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True).sum(-1)


class DistillationLoss:
    """`alpha * T^2 * KL + (1 - alpha) * CE (+ hidden_weight * MSE)`; the teacher is `trainer.extra_modules`'."""

    def __init__(self, config: DistillationConfig | None = None) -> None:
        self.config = config or DistillationConfig()

    def __call__(self, trainer: Any, model: nn.Module, batch: dict[str, torch.Tensor], num_items: int) -> LossOutput:
        config = self.config
        teacher = trainer.extra_modules[TEACHER]
        hidden = config.matches_hidden_states
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        student = _student_of(trainer, model)
        if config.alpha == 1.0 and not hidden and takes_chunked_head(student, teacher):
            return self._from_hidden_states(model, student, teacher, inputs, batch["labels"], num_items)
        with torch.no_grad():
            teacher_out = teacher(**inputs, output_hidden_states=hidden)
        if config.alpha == 1.0:  # no cross-entropy gradient: the log's comes with the KL, from the same chunks
            student_out = model(**inputs, output_hidden_states=hidden)
        else:
            student_out = model(**batch, num_items_in_batch=num_items, output_hidden_states=hidden)
        scored = batch["labels"][:, 1:] != IGNORE_INDEX  # the positions the cross-entropy scores
        if student_out.logits.shape[-1] != teacher_out.logits.shape[-1]:
            raise VocabularyMismatchError(
                f"the teacher gives {teacher_out.logits.shape[-1]} logits per token, the student "
                f"{student_out.logits.shape[-1]}: they do not share a vocabulary"
            )
        kl_sum, ce_sum = kl_and_cross_entropy(student_out.logits, teacher_out.logits, batch["labels"],
                                              config.temperature)  # fmt: skip
        kl = kl_sum / num_items
        ce = ce_sum / num_items if config.alpha == 1.0 else student_out.loss
        loss = config.alpha * config.temperature**2 * kl + (1.0 - config.alpha) * ce
        metrics = {"kl": kl.detach(), "ce": ce.detach()}
        if hidden:
            mse = self._hidden_error(trainer, student_out, teacher_out, scored) / num_items
            loss = loss + config.hidden_weight * mse
            metrics["hidden_mse"] = mse.detach()
        return LossOutput(loss=loss, metrics=metrics)

    def _from_hidden_states(self, model, student, teacher, inputs, labels, num_items) -> LossOutput:
        """The KL term alone, each model's head applied a chunk of rows at a time (`quantlab.distill.chunked_head`)."""
        with heads_taken_out(student, teacher) as (student_head, teacher_head):
            with torch.no_grad():
                teacher_hidden = teacher(**inputs).logits
            student_hidden = model(**inputs).logits  # through `model`, so DDP syncs the student
        kl_sum, ce_sum = kl_from_hidden_states(student_hidden, teacher_hidden, student_head, teacher_head, labels,
                                               self.config.temperature)  # fmt: skip
        kl = kl_sum / num_items
        loss = self.config.temperature**2 * kl
        return LossOutput(loss=loss, metrics={"kl": kl.detach(), "ce": (ce_sum / num_items).detach()})

    @staticmethod
    def count_items(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tokens the terms are summed over: those with a next-token label."""
        return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()

    def _hidden_error(self, trainer: Any, student_out, teacher_out, scored: torch.Tensor) -> torch.Tensor:
        pairs = self.config.layer_pairs
        student_states = [student_out.hidden_states[s][:, :-1][scored] for s, _ in pairs]
        teacher_states = [teacher_out.hidden_states[t][:, :-1][scored] for _, t in pairs]
        projected = trainer.extra_modules[HIDDEN_PROJECTION](student_states)
        return hidden_state_error(projected, teacher_states).sum()


class EncoderDistillationLoss:
    """`1 - cos(student, teacher)` of the last hidden states, summed over real tokens / `num_items`, plus
    `embedding_weight` x the mean over the micro-batch's examples of `1 - cos` of their mean-pooled sentence
    embeddings (as `quantlab.eval.embeddings` pools them), weighted by the micro-batch's share of the step's
    tokens, so gradient accumulation and several processes add the micro-batches' terms as the token term.

    Logged as `cosine_distance` (and `embedding_distance`). The token count is the attention mask's."""

    def __init__(self, config: DistillationConfig | None = None) -> None:
        self.embedding_weight = config.embedding_weight if config is not None else 0.0

    def __call__(self, trainer: Any, model: nn.Module, batch: dict[str, torch.Tensor], num_items: int) -> LossOutput:
        teacher = trainer.extra_modules[TEACHER]
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        with torch.no_grad():
            teacher_states = teacher(**inputs, output_hidden_states=True).hidden_states[-1]
        student_states = model(**inputs, output_hidden_states=True).hidden_states[-1]
        real = batch["attention_mask"].bool()
        cosine = F.cosine_similarity(student_states[real].float(), teacher_states[real].float(), dim=-1)
        loss = (1.0 - cosine).sum() / num_items
        metrics = {"cosine_distance": loss.detach()}
        if self.embedding_weight:
            pooled = F.cosine_similarity(mean_pooled(student_states, batch["attention_mask"]),
                                         mean_pooled(teacher_states, batch["attention_mask"]), dim=-1)  # fmt: skip
            share = real.sum() / num_items  # this micro-batch's part of the step
            embedding = (1.0 - pooled).mean() * share
            loss = loss + self.embedding_weight * embedding
            metrics["embedding_distance"] = embedding.detach()
        return LossOutput(loss=loss, metrics=metrics)

    @staticmethod
    def count_items(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["attention_mask"].sum()


def _student_of(trainer: Any, model: nn.Module) -> nn.Module:
    """The student inside the model the trainer runs (DDP and `DistillationModel` unwrapped)."""
    accelerator = getattr(trainer, "accelerator", None)
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else model
    return getattr(unwrapped, "student", unwrapped)


def distillation_loss(student: nn.Module, config: DistillationConfig) -> "DistillationLoss | EncoderDistillationLoss":
    """The loss that fits `student`: KL on next-token logits for a causal LM, hidden-state cosine for an encoder.

    An encoder takes no soft-target settings: `alpha` below 1 (cross-entropy on next tokens) or
    hidden-state matching through a projection are refused with the reason."""
    if is_language_model(student):
        if config.embedding_weight:
            raise ConfigError(
                f"{type(student).__name__} is a causal language model: embedding_weight matches an encoder's "
                "sentence embeddings; set it to 0"
            )
        return DistillationLoss(config)
    check_encoder_distillation(type(student).__name__, config)
    return EncoderDistillationLoss(config)


def check_encoder_distillation(model_name: str, config: DistillationConfig) -> None:
    """Raise `ConfigError` unless `config` suits an encoder: the KL share (`alpha`) 1, no hidden projection."""
    if config.alpha != 1.0 or config.matches_hidden_states:
        raise ConfigError(
            f"{model_name} is an encoder: it is distilled on its last hidden states alone, so alpha must be 1 "
            f"and hidden_weight 0 (got alpha={config.alpha:g}, hidden_weight={config.hidden_weight:g})"
        )
