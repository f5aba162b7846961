"""Saying what merging a LoRA adapter into a quantized base costs, measured.

`merge_and_unload()` (and `merge_adapter()`) on a quantized base re-quantizes each merged
weight (`QuantizedLoraLinear.merge`): the small LoRA update mostly rounds back onto the old
grid, so the merged model no longer computes what the adapter model did. PEFT only says
"may get different generations" for bitsandbytes; here each layer measures the rounding
(`||Q(W + dW) - (W + dW)||`) and one `RequantizationWarning` per merge reports it against
the weights and against the update, with the worst layer, and points to the float merge.
PEFT has no hook around a whole merge, so `LoraModel.merge_and_unload`/`merge_adapter` are
wrapped to gather the layers' figures; a layer merged on its own warns for itself.
"""

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quantlab.errors import RequantizationWarning
from quantlab.integrations.patching import wrap

FLOAT_MERGE_HINT = (
    "To keep the adapter exact, merge in float instead: quantlab.training.merge_to_float(peft_model), or load the "
    "base model without quantization, PeftModel.from_pretrained(base, adapter).merge_and_unload(), and quantize "
    "the result again"
)


@dataclasses.dataclass(frozen=True)
class LayerRounding:
    """Squared Frobenius norms of one merged layer: the rounding error, the LoRA update, the exact merged weight."""

    layer: nn.Module
    method: str
    error: float
    update: float
    weight: float


_collecting: list[list[LayerRounding]] = []


def record_rounding(
    layer: nn.Module, method: str, exact: torch.Tensor, update: torch.Tensor, merged: torch.Tensor
) -> None:
    """Note how far re-quantizing moved `layer`'s merged weight; warns at once outside a model-wide merge."""
    exact, update, merged = (tensor.detach().float() for tensor in (exact, update, merged))
    rounding = LayerRounding(
        layer,
        method,
        error=float((merged - exact).square().sum()),
        update=float(update.square().sum()),
        weight=float(exact.square().sum()),
    )
    if _collecting:
        _collecting[-1].append(rounding)
    else:
        warnings.warn(rounding_message("merge", [rounding], {}), RequantizationWarning, stacklevel=3)


def rounding_message(operation: str, roundings: list[LayerRounding], names: dict[int, str]) -> str:
    """One paragraph: relative weight error, share of the update lost, worst layer, and the float merge."""
    error = sum(r.error for r in roundings)
    weight_error = math.sqrt(error / max(sum(r.weight for r in roundings), 1e-30))
    methods = ", ".join(sorted({r.method for r in roundings}))
    message = (
        f"{operation}() re-quantized {len(roundings)} merged layer(s) with {methods}: the rounding moved the merged "
        f"weights by a relative weight error of {100 * weight_error:.3g}% (RMS, over all merged layers)"
    )
    update = sum(r.update for r in roundings)
    if update > 0:
        message += f", {100 * math.sqrt(error / update):.3g}% of the size of the LoRA update itself"
    if update > 0 and len(roundings) > 1:
        worst = max(roundings, key=lambda r: r.error / r.update if r.update > 0 else 0.0)
        worst_name = names.get(id(worst.layer), type(worst.layer).__name__)
        message += f" (worst layer {worst_name}: {100 * math.sqrt(worst.error / worst.update):.3g}%)"
    return f"{message}; the merged model does not compute what the adapter model did. {FLOAT_MERGE_HINT}"


def patch_lora_merges(lora_model_module: Any) -> None:
    model_class = lora_model_module.LoraModel
    wrap(model_class, "merge_and_unload", _reporting_rounding)
    wrap(model_class, "merge_adapter", _reporting_rounding)


def _reporting_rounding(original: Callable[..., Any]) -> Callable[..., Any]:
    def merge(self: Any, *args: Any, **kwargs: Any) -> Any:
        names = {id(module): name for name, module in self.model.named_modules()}
        roundings: list[LayerRounding] = []
        _collecting.append(roundings)
        try:
            result = original(self, *args, **kwargs)
        finally:
            _collecting.pop()
        if roundings:
            message = rounding_message(original.__name__, roundings, names)
            warnings.warn(message, RequantizationWarning, stacklevel=2)
        return result

    return merge
