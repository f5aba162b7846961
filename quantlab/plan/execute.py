"""Running a plan on a model: the steps the executors share.

`quantize_loaded` quantizes a model whose float weights are in memory (`quantlab.quantize`, and the
transformers quantizer once a calibrated config's float model is loaded): the calibrated blocks,
then every other planned layer with the data-free config, then the vocabulary tables.
`empty_layers` puts empty quantized layers in the planned places (the loader fills them tensor by
tensor; the streamed quantization's output model names what it writes).
"""

from typing import Any

import torch
from torch import nn

from quantlab.plan.plan import QuantizationPlan
from quantlab.replacement import raise_nothing_to_quantize, replace_experts, replace_linear_layers
from quantlab.vocabulary import replace_vocabulary


def quantize_loaded(
    model: nn.Module,
    plan: QuantizationPlan,
    calibration: torch.Tensor | list[str] | None = None,
    tokenizer: Any = None,
    progress: bool = True,
) -> list[str]:
    """Quantize the plan's layers and tables of the loaded `model` in place; returns the layers' names."""
    converted: list[str] = []
    if plan.needs_calibration:
        # calibration's modules load when a config needs them, not with `import quantlab`
        from quantlab.calibration.model import calibrate

        converted = calibrate(model, plan, calibration, tokenizer, progress)
    converted += replace_linear_layers(model, plan.data_free, plan.module_class, plan.selects, quantize=True)
    converted += replace_experts(model, plan.data_free, plan.module_class, plan.experts_modules, quantize=True)
    if not converted:
        raise_nothing_to_quantize(model, plan)
    replace_vocabulary(model, plan.config, quantize=True)  # the float embedding served calibration; now its turn
    return converted


def empty_layers(model: nn.Module, plan: QuantizationPlan) -> list[str]:
    """Put empty quantized layers and tables where the plan quantizes (on each module's device: meta while
    transformers loads); returns the layers' names."""
    converted = replace_linear_layers(model, plan.config, plan.module_class, plan.selects, quantize=False)
    converted += replace_experts(model, plan.config, plan.module_class, plan.experts_modules, quantize=False)
    if not converted:
        raise_nothing_to_quantize(model, plan)
    replace_vocabulary(model, plan.config, quantize=False)
    return converted
