"""Swapping a model's Linear layers for quantized layers and back.

The layers to convert are the plan's (`quantlab.plan`); they become a method's quantized layer
(empty while transformers loads, or quantized from the float weight). A model left with nothing
to quantize is refused.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from quantlab.config import QuantlabConfig
from quantlab.errors import QuantizationError
from quantlab.nn import QuantizedLinear
from quantlab.nn.kinds import as_linear, is_quantizable_linear
from quantlab.nn.quantized_experts import PROJECTIONS, QuantizedExperts, expert_configs
from quantlab.vocabulary import dequantize_vocabulary

if TYPE_CHECKING:
    from quantlab.plan import QuantizationPlan


def replace_linear_layers(
    model: nn.Module,
    config: QuantlabConfig,
    module_class: type[QuantizedLinear],
    selected: Callable[[str], bool],
    quantize: bool,
) -> list[str]:
    """Swap the selected Linear layers (`quantlab.nn.kinds`) for `module_class`; returns their names.

    With `quantize` false the new layers are empty shells (on the Linear's device: meta while
    transformers loads); otherwise they are quantized from the Linear's weight.
    """
    converted = []
    for name, module in list(model.named_modules()):
        if not is_quantizable_linear(module) or not selected(name):
            continue
        layer_config = config.config_for(name)
        linear = as_linear(module)  # GPT-2's `Conv1D` as the Linear layer of its transposed weight
        if quantize:
            new = module_class.from_linear(linear, layer_config, layer=name)
        else:
            new = module_class(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                layer_config,
                dtype=linear.weight.dtype,
                device=linear.weight.device,
            )
        model.set_submodule(name, new)
        converted.append(name)
    return converted


def replace_experts(
    model: nn.Module, config: QuantlabConfig, module_class: type[QuantizedLinear], names: list[str], quantize: bool
) -> list[str]:
    """Swap the fused experts modules `names` still in float for `QuantizedExperts` in `module_class`'s format
    (empty shells with `quantize` false; else each expert quantized by `config`'s data-free solver); returns
    the names of the projections swapped."""
    converted = []
    for name in names:
        experts = model.get_submodule(name)
        if isinstance(experts, QuantizedExperts):
            continue
        configs = expert_configs(config, name)
        if quantize:
            new = QuantizedExperts.from_float(experts, module_class, configs, name)
        else:
            new = QuantizedExperts.empty_like(experts, module_class, configs)
        model.set_submodule(name, new)
        converted += [f"{name}.{projection}" for projection in PROJECTIONS]
    return converted


def dequantize_layers(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every quantized layer and vocabulary table by its float module, in place; drop the quantizer."""
    dequantize_vocabulary(model, dtype)
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            model.set_submodule(name, module.to_linear(dtype))
        elif isinstance(module, QuantizedExperts):
            model.set_submodule(name, module.to_float(dtype or torch.float32))
    for attribute in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attribute):
            delattr(model, attribute)
    if hasattr(model, "config") and hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    return model


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    """The model's quantized Linear layers by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def quantized_experts(model: nn.Module) -> dict[str, QuantizedExperts]:
    """The model's quantized fused experts modules by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedExperts)}


def raise_nothing_to_quantize(model: nn.Module, plan: "QuantizationPlan") -> None:
    """A model with no layer to quantize is an error, never a float model passed off as quantized."""
    unhandled = plan.unhandled()
    if unhandled:
        owners = sorted({type(model.get_submodule(w.name.rpartition(".")[0])).__name__ for w in unhandled})
        why = f"its weights are in {', '.join(owners)} layers, which no quantized module handles ({unhandled[0].name})"
    else:
        why = "check modules_to_not_convert"
    raise QuantizationError(
        f"{type(model).__name__} has no nn.Linear layer left to quantize with {plan.config.method!r}: {why}"
    )
