"""Swapping a model's `nn.Linear` layers for quantized layers and back.

The steps `quantlab.quantize` and the transformers quantizer share: both pick the layers to
convert, replace them with a method's quantized layer (empty while transformers loads, or
quantized from the float weight), and refuse a model left with nothing to quantize or a
`layer_options` entry that names none of the layers to convert (a typo would otherwise change nothing).
"""

import warnings
from collections.abc import Callable

import torch
from torch import nn

from quantlab.config import QuantlabConfig
from quantlab.errors import ConfigError, PaddedGroupsWarning, QuantizationError
from quantlab.nn import QuantizedLinear
from quantlab.nn.rotation import rotation_block
from quantlab.vocabulary import dequantize_vocabulary, vocabulary_linears


def replace_linear_layers(
    model: nn.Module,
    config: QuantlabConfig,
    module_class: type[QuantizedLinear],
    selected: Callable[[str], bool],
    quantize: bool,
) -> list[str]:
    """Swap the selected `nn.Linear` layers for `module_class`; returns their names.

    With `quantize` false the new layers are empty shells (on the Linear's device: meta while
    transformers loads); otherwise they are quantized from the Linear's weight.
    """
    converted = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not selected(name):
            continue
        layer_config = config.config_for(name)
        if quantize:
            new = module_class.from_linear(module, layer_config, layer=name)
        else:
            new = module_class(
                module.in_features,
                module.out_features,
                module.bias is not None,
                layer_config,
                dtype=module.weight.dtype,
                device=module.weight.device,
            )
        model.set_submodule(name, new)
        converted.append(name)
    return converted


def dequantize_layers(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every quantized layer and vocabulary table by its float module, in place; drop the quantizer."""
    dequantize_vocabulary(model, dtype)
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            model.set_submodule(name, module.to_linear(dtype))
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


def without_vocabulary(
    model: nn.Module, config: QuantlabConfig, selected: Callable[[str], bool]
) -> Callable[[str], bool]:
    """`selected` less the output head when `embedding_bits` quantizes it as a vocabulary table."""
    tables = vocabulary_linears(model, config)
    if not tables:
        return selected
    return lambda name: name not in tables and selected(name)


def check_layer_options(model: nn.Module, config: QuantlabConfig, selected: Callable[[str], bool]) -> None:
    """Raise `ConfigError` if a `layer_options` entry names no Linear layer of `model` that `selected` converts,
    or `rotate_inputs` matches none, or a layer it matches cannot be rotated (before any work is done:
    calibrating a large model takes hours)."""
    if not config.layer_options and not config.rotate_inputs:
        return
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear and selected(name)]
    _check_rotated_layers(model, config, names)
    if not config.layer_options:
        return
    unknown = sorted(set(config.layer_options) - set(names))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        example = f" (they are named like {names[0]!r})" if names else ""
        raise ConfigError(
            f"{config.method}: layer_options names {unknown[0]!r}{more}, which is not a layer this model "
            f"quantizes{example}: correct the name, or remove the entry"
        )


def _check_rotated_layers(model: nn.Module, config: QuantlabConfig, names: list[str]) -> None:
    if not config.rotate_inputs:
        return
    rotated = [name for name in names if config.rotates_input_of(name)]
    if not rotated:
        example = f" (they are named like {names[-1]!r})" if names else ""
        raise ConfigError(
            f"{config.method}: rotate_inputs={list(config.rotate_inputs)!r} matches no layer this model quantizes"
            f"{example}: correct the names, or drop rotate_inputs"
        )
    for name in rotated:
        try:
            rotation_block(model.get_submodule(name).in_features, config.rotation_blocks)
        except ConfigError as error:
            raise ConfigError(f"{config.method}: {name}: {error}") from None


def warn_padded_groups(
    model: nn.Module, config: QuantlabConfig, module_class: type[QuantizedLinear], selected: Callable[[str], bool]
) -> list[str]:
    """Warn (one line) when a group size does not divide a selected layer's inputs: its last group is padded,
    so every row stores codes for inputs it does not have (groups of 128 on 576 inputs store 640 codes a row).
    Returns the padded layers' names."""
    padded: list[tuple[str, int, int, int]] = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and selected(name):
            layout = module_class.layout_for(module.in_features, module.out_features, config.config_for(name))
            stored = layout.groups * layout.group_length
            if stored != module.in_features:
                padded.append((name, module.in_features, layout.group_length, stored))
    if padded:
        name, inputs, group, stored = padded[0]
        more = f" and {len(padded) - 1} more layer(s)" if len(padded) > 1 else ""
        fits = [size for size in (32, 64, 128, 256) if inputs % size == 0]
        hint = f"groups of {', '.join(map(str, fits))} divide {inputs}" if fits else "a smaller group divides it"
        warnings.warn(
            f"{config.method}: {name}{more} pad their last group: {inputs} inputs in groups of {group} store "
            f"{stored} codes a row (+{100 * (stored - inputs) / inputs:.0f} %); {hint}",
            PaddedGroupsWarning,
            stacklevel=3,
        )
    return [entry[0] for entry in padded]


def raise_nothing_to_quantize(model: nn.Module, config: QuantlabConfig) -> None:
    """A model with no layer to quantize is an error, never a float model passed off as quantized."""
    kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ == "Conv1D"})
    why = (
        f"its projections are {kinds[0]} layers (GPT-2 style), which quantlab does not quantize yet"
        if kinds
        else "check modules_to_not_convert"
    )
    raise QuantizationError(
        f"{type(model).__name__} has no nn.Linear layer left to quantize with {config.method!r}: {why}"
    )
