"""One-shot magnitude pruning, unstructured (per layer or global) and N:M.

The weights stay dense in memory with zeros where pruned, and each layer keeps its mask
(`quantlab.prune.layer_masks`) so fine-tuning can hold the pattern. Storage shrinks on save
(`quantlab.prune.storage.save_sparse`); for layers that shrink in memory and run faster, see
`quantlab.prune.structured`.
"""

import dataclasses

import torch
from torch import nn

from quantlab.errors import ConfigError
from quantlab.prune.layer_masks import attach_mask, mask_of
from quantlab.prune.mask_rules import global_magnitude_masks, magnitude_mask, nm_mask
from quantlab.prune.patterns import SparsityPattern, parse_pattern, resolve_sparsity
from quantlab.prune.targets import prunable_layers

SCOPES = ("layer", "global")


@dataclasses.dataclass
class PruningResult:
    """What one pruning pass did: the pattern, and each layer's fraction of weights removed."""

    pattern: str
    sparsity: float
    scope: str
    layers: dict[str, float] = dataclasses.field(default_factory=dict)
    removed: int = 0
    total: int = 0

    @property
    def achieved_sparsity(self) -> float:
        """Fraction of the pruned layers' weights that are masked out (weighted by layer size)."""
        return self.removed / max(1, self.total)


def prune(
    model: nn.Module,
    pattern: "str | SparsityPattern" = "unstructured",
    sparsity: float | None = None,
    scope: str = "layer",
    modules: list[str] | None = None,
) -> PruningResult:
    """Magnitude-prune the Linear layers of `model` in place and attach their masks.

    `pattern`: "unstructured" or "N:M" ("2:4", "4:8"); `sparsity`: the fraction of weights to
    remove, in [0, 1) (fixed by N:M patterns). `scope="layer"` removes that fraction from each
    layer; `scope="global"` ranks all layers' weights together (unstructured only). A layer
    pruned before stays pruned where it was (the new mask is intersected with the old one), so
    calling this with rising sparsity is gradual pruning. `modules`: layer names (default:
    every Linear but the output head).
    """
    pattern = parse_pattern(pattern)
    if pattern.kind == "structured":
        raise ConfigError("structured pruning removes neurons and heads: call quantlab.prune.prune_structured")
    sparsity = resolve_sparsity(pattern, sparsity)
    if scope not in SCOPES:
        raise ConfigError(f"scope={scope!r} is not valid; choose one of {', '.join(SCOPES)}")
    if scope == "global" and pattern.is_nm:
        raise ConfigError(f"scope='global' applies to unstructured pruning; {pattern} is decided per group of weights")
    layers = prunable_layers(model, modules)
    if not layers:
        raise ConfigError(f"{type(model).__name__} has no Linear layer to prune")
    masks = compute_masks(layers, pattern, sparsity, scope)
    result = PruningResult(str(pattern), sparsity, scope)
    for name, layer in layers.items():
        old = mask_of(layer)
        mask = masks[name] if old is None else masks[name] & old
        attach_mask(layer, mask)
        removed = int((~mask).sum())
        result.layers[name] = removed / mask.numel()
        result.removed += removed
        result.total += mask.numel()
    return result


def compute_masks(
    layers: dict[str, nn.Linear], pattern: SparsityPattern, sparsity: float, scope: str = "layer"
) -> dict[str, torch.Tensor]:
    """The masks `prune` would attach, without touching the layers (a layer's old mask is kept inside)."""
    weights = {name: _masked_weight(layer) for name, layer in layers.items()}
    if pattern.is_nm:
        return {name: nm_mask(w, pattern.n, pattern.m, layer=name) for name, w in weights.items()}
    if scope == "global":
        return global_magnitude_masks(weights, sparsity)
    return {name: magnitude_mask(w, sparsity) for name, w in weights.items()}


def _masked_weight(layer: nn.Linear) -> torch.Tensor:
    weight = layer.weight.detach()
    mask = mask_of(layer)
    return weight if mask is None else weight.masked_fill(~mask, 0)
