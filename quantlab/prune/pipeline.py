"""Pruning by pattern name: what `quantlab prune` runs before recovery training, as library calls.

`prune_by_pattern` checks the options against the pattern before anything changes and
dispatches to magnitude pruning (unstructured, N:M: masks attached) or structured pruning
(smaller matrices). Recovery training afterwards is `quantlab.distill.recover`.
"""

import dataclasses
from typing import Any

import torch
from torch import nn

from quantlab.errors import ConfigError
from quantlab.prune.patterns import SparsityPattern, check_sparsity, parse_pattern, resolve_sparsity
from quantlab.prune.structured import prune_structured
from quantlab.prune.unstructured import prune


@dataclasses.dataclass(frozen=True)
class PruningOutcome:
    """What pruning removed: the fraction (of weights, or of MLP neurons when structured) and the layers pruned."""

    sparsity: float
    layers: int


def pattern_sparsity(pattern: str | SparsityPattern, sparsity: float | None, head_sparsity: float = 0.0) -> float:
    """The sparsity `pattern` prunes to, with `head_sparsity` checked against it (structured patterns only)."""
    pattern = parse_pattern(pattern) if isinstance(pattern, str) else pattern
    if pattern.kind != "structured":
        if head_sparsity:
            raise ConfigError("head_sparsity (--head-sparsity) is for the pattern structured only")
        return resolve_sparsity(pattern, sparsity)
    mlp = check_sparsity(sparsity if sparsity is not None else 0.0, "sparsity")
    if check_sparsity(head_sparsity, "head_sparsity") == 0 and mlp == 0:
        raise ConfigError(
            "structured pruning needs sparsity (of MLP neurons, --sparsity) and/or head_sparsity (of attention heads, "
            "--head-sparsity)"
        )
    return mlp


def prune_by_pattern(
    model: nn.Module,
    pattern: str | SparsityPattern,
    sparsity: float | None = None,
    *,
    scope: str = "layer",
    head_sparsity: float = 0.0,
    calibration: list[dict[str, torch.Tensor]] | None = None,
) -> PruningOutcome:
    """Prune `model` in place: magnitude masks (unstructured, N:M) or smaller layers (structured, scored on
    `calibration` batches when given, by weight norms otherwise)."""
    pattern = parse_pattern(pattern) if isinstance(pattern, str) else pattern
    fraction = pattern_sparsity(pattern, sparsity, head_sparsity)
    if pattern.kind != "structured":
        result = prune(model, pattern, fraction, scope=scope)
        return PruningOutcome(result.achieved_sparsity, len(result.layers))
    result = prune_structured(model, mlp_sparsity=fraction, head_sparsity=head_sparsity, calibration=calibration)
    return PruningOutcome(result.neuron_sparsity, model.config.num_hidden_layers)


def first_examples(train: Any, count: int) -> list[dict[str, torch.Tensor]]:
    """The first `count` training examples as batches of one: structured pruning's calibration."""
    return [{"input_ids": train[i]["input_ids"].unsqueeze(0)} for i in range(min(count, len(train)))]
