"""Pruning during fine-tuning, as `transformers.TrainerCallback`s (for `quantlab.training.Trainer`).

`KeepMasks` holds the masks a model already has (one-shot pruning, or a sparse checkpoint
loaded with its masks) through every optimizer step. `GradualPruning` also raises the
sparsity along the cubic schedule of Zhu & Gupta 2017 (arXiv 1710.01878), recomputing
magnitude masks every `frequency` steps from `start_step` to `end_step`, so the network
adapts while weights go; masks only ever grow, a pruned weight never returns.

Gradients of pruned weights are zeroed by a hook as backward computes them, so gradient
clipping, DDP's all-reduce and the optimizer see only live weights; after each optimizer step
the pruned weights are zeroed again (weight decay and momentum cannot revive them). Both
callbacks store their masks (packed, 1 bit per weight) in quantlab's checkpoints
(`state_dict`/`load_state_dict`), so a resumed run holds and continues exactly the masks of
the interrupted one.
"""

import functools
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from quantlab.errors import ConfigError
from quantlab.prune.bitmask import pack_bits, unpack_bits
from quantlab.prune.layer_masks import apply_masks, attach_mask, mask_of, masked_layers
from quantlab.prune.mask_rules import cubic_sparsity
from quantlab.prune.patterns import SparsityPattern, check_sparsity, parse_pattern
from quantlab.prune.unstructured import SCOPES, prune


class KeepMasks(TrainerCallback):
    """Hold every pruning mask of the trained model through each optimizer step."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self._pending: dict[str, Any] | None = None

    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs) -> None:
        self.model = model
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None
        apply_masks(model)
        for layer in model.modules():  # layers pruned later (GradualPruning) are held from their first mask on
            weight = getattr(layer, "weight", None)
            if isinstance(layer, nn.Linear) and weight is not None and weight.requires_grad:
                weight.register_hook(functools.partial(_masked_gradient, layer))

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        apply_masks(self.model)

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        """The masked fraction joins the record: for the other callbacks (`logs`) and in `log_history`."""
        if logs is not None and self.model is not None:
            logs["sparsity"] = masked_fraction(self.model)
            if state.log_history:  # Trainer appended this record's copy just before calling on_log
                state.log_history[-1]["sparsity"] = logs["sparsity"]

    def state_dict(self) -> dict[str, Any]:
        if self.model is None:
            return {"masks": {}, "numel": {}}
        layers = masked_layers(self.model)
        return {
            "masks": {name: pack_bits(mask_of(layer).cpu()) for name, layer in layers.items()},
            "numel": {name: layer.weight.numel() for name, layer in layers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The loop restores callback state before `on_train_begin`, when the model is not known yet.
        if self.model is None:
            self._pending = state
        else:
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        named = dict(self.model.named_modules())
        for name, packed in state["masks"].items():
            layer = named.get(name)
            if layer is None:
                raise ConfigError(f"the checkpoint holds a pruning mask for {name!r}, which this model does not have")
            mask = unpack_bits(packed, state["numel"][name]).view(layer.weight.shape)
            attach_mask(layer, mask)


class GradualPruning(KeepMasks):
    """Prune during training from `initial_sparsity` to `final_sparsity` on the cubic schedule.

    Masks are recomputed at optimizer steps `start_step, start_step + frequency, ...` up to
    `end_step` (magnitude pruning, `scope` "layer" or "global", on `modules` or every Linear
    but the output head) and held at every step. An N:M pattern has one sparsity, so it is
    applied once at `start_step` and then held.
    """

    def __init__(
        self,
        final_sparsity: float | None = None,
        *,
        end_step: int,
        start_step: int = 0,
        initial_sparsity: float = 0.0,
        frequency: int = 1,
        pattern: "str | SparsityPattern" = "unstructured",
        scope: str = "layer",
        modules: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.pattern = parse_pattern(pattern)
        if self.pattern.kind == "structured":
            raise ConfigError("gradual pruning is unstructured or N:M; prune structurally once before training")
        if self.pattern.is_nm:
            final_sparsity = self.pattern.sparsity if final_sparsity is None else final_sparsity
            initial_sparsity = final_sparsity
        if final_sparsity is None:
            raise ConfigError("GradualPruning needs final_sparsity (the fraction of weights removed at end_step)")
        self.final_sparsity = check_sparsity(final_sparsity, "final_sparsity")
        self.initial_sparsity = check_sparsity(initial_sparsity, "initial_sparsity")
        if self.initial_sparsity > self.final_sparsity:
            raise ConfigError(
                f"initial_sparsity={initial_sparsity} exceeds final_sparsity={final_sparsity}; sparsity only rises"
            )
        if not (isinstance(start_step, int) and isinstance(end_step, int) and 0 <= start_step <= end_step):
            raise ConfigError(f"need whole steps 0 <= start_step <= end_step, got {start_step} and {end_step}")
        if not isinstance(frequency, int) or frequency < 1:
            raise ConfigError(f"frequency={frequency!r} must be a whole number of steps >= 1")
        if scope not in SCOPES:
            raise ConfigError(f"scope={scope!r} is not valid; choose one of {', '.join(SCOPES)}")
        self.start_step, self.end_step, self.frequency = start_step, end_step, frequency
        self.scope, self.modules = scope, modules
        self.sparsity: float | None = None  # the sparsity the current masks were computed for

    def target(self, step: int) -> float:
        """The scheduled sparsity before optimizer step `step` (0-based)."""
        return cubic_sparsity(
            step, self.initial_sparsity, self.final_sparsity, self.start_step, self.end_step, self.frequency
        )

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        step = state.global_step
        if step < self.start_step:
            return
        target = self.target(step)
        if self.sparsity is None or target > self.sparsity:
            prune(self.model, self.pattern, None if self.pattern.is_nm else target, self.scope, self.modules)
            self.sparsity = target

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sparsity": self.sparsity}

    def settings(self) -> dict[str, Any]:
        return {
            "pattern": str(self.pattern),
            "initial_sparsity": self.initial_sparsity,
            "final_sparsity": self.final_sparsity,
            "start_step": self.start_step,
            "end_step": self.end_step,
            "frequency": self.frequency,
            "scope": self.scope,
            "modules": self.modules,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.sparsity = state.get("sparsity")


def _masked_gradient(layer: nn.Module, grad: torch.Tensor) -> torch.Tensor:
    mask = mask_of(layer)
    return grad if mask is None else grad.masked_fill(~mask, 0)


def masked_fraction(model: nn.Module) -> float:
    """Fraction of the masked layers' weights that are masked out."""
    removed = total = 0
    for layer in masked_layers(model).values():
        mask = mask_of(layer)
        removed += int((~mask).sum())
        total += mask.numel()
    return removed / total if total else 0.0
