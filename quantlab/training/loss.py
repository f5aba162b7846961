"""Losses of the shared loop, normalized so that accumulation and processes add up exactly.

A loss function is called once per micro-batch as `loss_fn(trainer, model, batch, num_items)`
and returns a `LossOutput` whose `loss` is the micro-batch's summed token loss divided by
`num_items`, the number of predicted tokens in the whole optimizer step across all
micro-batches and processes. The loop then only adds, so the step's loss is the exact mean
over its tokens however they fall into micro-batches (padding no longer weighs short
examples more, the accumulation bug of mean-of-means). Extra terms (a distillation KL, say)
go in `metrics`, normalized the same way, and are logged summed.
"""

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from quantlab.training.data import IGNORE_INDEX

if TYPE_CHECKING:
    from quantlab.training.trainer import Trainer


@dataclasses.dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


class LossFunction(Protocol):
    def __call__(
        self, trainer: "Trainer", model: nn.Module, batch: dict[str, torch.Tensor], num_items: int
    ) -> LossOutput: ...


def predicted_tokens(batch: dict[str, Any]) -> int:
    """Tokens a causal LM is scored on: labels after the shift that are not padding."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


class CausalLMLoss:
    """Next-token cross-entropy as the model computes it, summed and divided by `num_items`."""

    def __call__(
        self, trainer: "Trainer", model: nn.Module, batch: dict[str, torch.Tensor], num_items: int
    ) -> LossOutput:
        outputs = model(**batch, num_items_in_batch=num_items)
        return LossOutput(loss=outputs.loss)
