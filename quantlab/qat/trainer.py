"""Quantization-aware training on `transformers.Trainer`: the distillation loop, with fake-quantized layers.

`QATTrainer` is `DistillationTrainer` (KL from the frozen float teacher, exact token means, held-out
perplexity, pickle-free checkpoints and exact resume) with what fake quantizers need: each kind of
trained number gets its own parameter group (rounding offsets and zero points are in grid steps and
train at the run's learning rate; scales are ratios to their start and train at `scale_lr_ratio`
times it, as learned tables' levels do; normalization weights, when they train, at `norm_lr_ratio`
times it, float embedding tables and head at `embedding_lr_ratio` times it; only offsets take weight
decay, which pulls them back to their start), and after every optimizer step the numbers are put back
in their ranges (`project`).
"""

import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import TrainerCallback

from quantlab.distill.trainer import DistillationTrainer
from quantlab.errors import QuantlabError
from quantlab.nn.fake_quant import FakeQuantizedWeight
from quantlab.nn.grid_trained import GridTrainedLinear, TrainedGrid
from quantlab.qat.options import QATOptions
from quantlab.qat.swap import SwappedLayer, embedding_parameters, normalization_parameters

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

_SCALE, _ZERO, _OFFSET, _TABLE = "scale_ratio", "zero", "offset", "table"
_NORM, _EMBEDDING, _OTHER = "norm", "embedding", "other"
_QUANTIZER_KINDS = (_SCALE, _ZERO, _OFFSET, _TABLE)  # the trained numbers of a layer's quantizer, by attribute name
_GROUP_ORDER = (_OFFSET, _ZERO, _SCALE, _TABLE, _NORM, _EMBEDDING, _OTHER)  # the optimizer's groups, as checkpointed


class ProjectQuantizers(TrainerCallback):
    """Keeps each quantizer's offsets and scales in their ranges after every optimizer step.

    Its `settings()` join the checkpoint's fingerprint, so a resume with other QAT options is refused."""

    def __init__(self, quantizers: list[FakeQuantizedWeight | TrainedGrid], options: QATOptions) -> None:
        self.quantizers, self.options = quantizers, options

    def on_optimizer_step(
        self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any
    ) -> None:
        for quantizer in self.quantizers:
            quantizer.project()

    def settings(self) -> dict[str, Any]:
        return self.options.settings()


class StepTimes(TrainerCallback):
    """Wall seconds of each optimizer step (forward, backward, optimizer and projection), for the report."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._started = 0.0

    def on_step_begin(
        self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any
    ) -> None:
        self._started = time.perf_counter()

    def on_step_end(
        self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any
    ) -> None:
        self.seconds.append(time.perf_counter() - self._started)


class QATTrainer(DistillationTrainer):
    """Trains the fake quantizers of `student` (swapped in by `quantlab.qat.fake_quantize`) to match `teacher`."""

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        args: Any,
        train_dataset: Any = None,
        *,
        swapped: Mapping[str, SwappedLayer],
        options: QATOptions | None = None,
        callbacks: list | None = None,
        **kwargs: Any,
    ) -> None:
        if not swapped:
            raise QuantlabError("the student has no quantized Linear layer to train; quantize it first")
        trained = "grids" if all(isinstance(layer.fake, GridTrainedLinear) for layer in swapped.values()) else "weights"
        self.qat_options = dataclasses.replace(options or QATOptions(), train=trained)
        quantizers = [layer.quantizer for layer in swapped.values()]
        self.step_times = StepTimes()
        callbacks = [*(callbacks or []), ProjectQuantizers(quantizers, self.qat_options), self.step_times]
        super().__init__(student, teacher, args, train_dataset, callbacks=callbacks, **kwargs)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The run's optimizer (`optim`) over the parameter groups of `parameter_groups`."""
        if self.optimizer is None:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model or self.model)
            groups = parameter_groups(model or self.model, self.args.learning_rate, self.args.weight_decay,
                                      self.qat_options)  # fmt: skip
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer


def parameter_groups(
    model: nn.Module, learning_rate: float, weight_decay: float, options: QATOptions
) -> list[dict[str, Any]]:
    """Offsets (weight decay), zero points (none), scales and learned tables' levels (`scale_lr_ratio` x the
    rate: both are numbers near 1), normalization weights (`norm_lr_ratio` x the rate, no decay: it would
    pull gains to zero), float embedding tables and head (`embedding_lr_ratio` x the rate, no decay),
    anything else trainable."""
    norms = set(normalization_parameters(model)) if options.norm_lr_ratio is not None else set()
    embeddings = set(embedding_parameters(model)) if options.embedding_lr_ratio is not None else set()
    groups: dict[str, list[nn.Parameter]] = {kind: [] for kind in _GROUP_ORDER}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            attribute = name.rsplit(".", 1)[-1]
            if name in norms:
                kind = _NORM
            elif name in embeddings:
                kind = _EMBEDDING
            elif attribute in _QUANTIZER_KINDS and ".weight_quantizer." in f".{name}":
                kind = attribute
            else:
                kind = _OTHER
            groups[kind].append(parameter)
    settings = {
        _OFFSET: {"lr": learning_rate, "weight_decay": weight_decay},
        _ZERO: {"lr": learning_rate, "weight_decay": 0.0},
        _SCALE: {"lr": learning_rate * options.scale_lr_ratio, "weight_decay": 0.0},
        _TABLE: {"lr": learning_rate * options.scale_lr_ratio, "weight_decay": 0.0},
        _NORM: {"lr": learning_rate * (options.norm_lr_ratio or 1.0), "weight_decay": 0.0},
        _EMBEDDING: {"lr": learning_rate * (options.embedding_lr_ratio or 1.0), "weight_decay": 0.0},
        _OTHER: {"lr": learning_rate, "weight_decay": weight_decay},
    }
    return [{"params": params, **settings[kind]} for kind, params in groups.items() if params]
