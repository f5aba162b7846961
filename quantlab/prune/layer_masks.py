"""Masks attached to Linear layers, and what holds them through training.

A pruned layer carries its mask as a plain attribute `pruning_mask` (a bool tensor of the
weight's shape), not as a buffer or a parametrization: the weight keeps its name, so
`save_pretrained`, PEFT, quantization and optimizers see an ordinary `nn.Linear` whose pruned
weights are zero; the mask is not broadcast by DDP on every forward, and it is not written to
checkpoints (the training loop's callbacks store it, packed, see `quantlab.prune.schedule`).

Masks hold through fine-tuning by two calls per optimizer step: `mask_gradients` before the
step (pruned weights get no gradient, so clipping and the optimizer see only live weights) and
`apply_masks` after it (weight decay and momentum carried from earlier steps cannot revive a
pruned weight). `make_permanent` zeroes the weights one last time and drops the masks.
"""

import torch
from torch import nn

MASK_ATTRIBUTE = "pruning_mask"


def attach_mask(layer: nn.Module, mask: torch.Tensor) -> None:
    """Give `layer` the mask `mask` (True keeps a weight) and zero the weights it removes."""
    weight = layer.weight
    if mask.shape != weight.shape:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not fit a weight of shape {tuple(weight.shape)}")
    mask = mask.to(device=weight.device, dtype=torch.bool)
    object.__setattr__(layer, MASK_ATTRIBUTE, mask)
    with torch.no_grad():
        weight.masked_fill_(~mask, 0)


def mask_of(layer: nn.Module) -> torch.Tensor | None:
    """The layer's mask, on the weight's device (moved there once if the model moved)."""
    mask = getattr(layer, MASK_ATTRIBUTE, None)
    if mask is None:
        return None
    weight = layer.weight
    if mask.device != weight.device:
        mask = mask.to(weight.device)
        object.__setattr__(layer, MASK_ATTRIBUTE, mask)
    return mask


def masked_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every module of `model` that carries a pruning mask, by name."""
    return {name: module for name, module in model.named_modules() if getattr(module, MASK_ATTRIBUTE, None) is not None}


def apply_masks(model: nn.Module) -> int:
    """Zero every masked-out weight again; returns the number of masked layers."""
    layers = masked_layers(model)
    with torch.no_grad():
        for layer in layers.values():
            layer.weight.masked_fill_(~mask_of(layer), 0)
    return len(layers)


def mask_gradients(model: nn.Module) -> None:
    """Zero the gradients of masked-out weights (call after backward, before the optimizer step)."""
    for layer in masked_layers(model).values():
        grad = layer.weight.grad
        if grad is not None:
            grad.masked_fill_(~mask_of(layer), 0)


def make_permanent(model: nn.Module) -> int:
    """Zero the pruned weights for good and remove the masks; returns the number of layers unmasked."""
    count = apply_masks(model)
    for layer in masked_layers(model).values():
        object.__delattr__(layer, MASK_ATTRIBUTE)
    return count
