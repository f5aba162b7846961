"""Quantizing and dequantizing any loaded `nn.Module`, transformers model or not."""

from typing import Any

import torch
from torch import nn
from transformers.quantizers.base import get_keys_to_not_convert
from transformers.quantizers.quantizers_utils import should_convert_module

from quantlab.config import QuantlabConfig
from quantlab.errors import QuantizationError
from quantlab.integrations.chunked_loss import use_chunked_loss
from quantlab.integrations.transformers import quantizer_class_of
from quantlab.registry import method_of
from quantlab.replacement import (
    check_layer_options,
    dequantize_layers,
    raise_nothing_to_quantize,
    replace_linear_layers,
    warn_padded_groups,
    without_vocabulary,
)
from quantlab.vocabulary import replace_vocabulary


def quantize(
    model: nn.Module,
    config: QuantlabConfig,
    modules: list[str] | None = None,
    calibration: torch.Tensor | list[str] | None = None,
    tokenizer: Any = None,
    progress: bool = True,
) -> nn.Module:
    """Replace the Linear layers of `model` by the method's quantized layer, in place.

    `modules`: names of the layers to quantize (default: every Linear layer, less
    `config.modules_to_not_convert`, or transformers' default of the output head and tied
    embeddings). A transformers model comes back ready for `save_pretrained`.

    With `config.embedding_bits` set, the input embedding table and the output head are
    quantized too (round-to-nearest, after the Linear layers; a tied head keeps reading the
    embedding's codes).

    A calibrated config (`solver="gptq"`, `awq=True`) quantizes block by block on
    `calibration`: token ids `[samples, seq_len]`, a list of texts (with `tokenizer`), or None
    for `config.calibration_text` (default: the bundled WikiText-2 after the evaluation windows);
    with `config.self_calibration` the float model samples its own windows (no data, no tokenizer).
    """
    method = method_of(config)
    if type(model) is nn.Linear:
        return method.module_class.from_linear(model, config, layer="model")
    if modules is not None:
        _check_targets(model, modules)
        wanted = set(modules)
        selected = wanted.__contains__
    else:
        skip = _default_skips(model, config)
        selected = lambda name: should_convert_module(name, skip)  # noqa: E731
    selected = without_vocabulary(model, config, selected)
    check_layer_options(model, config, selected)
    warn_padded_groups(model, config, method.module_class, selected)
    converted, data_free = [], config
    if config.needs_calibration:
        # calibration's modules load when a config needs them, not with `import quantlab`
        from quantlab.calibration.model import calibrate, data_free_config

        converted = calibrate(model, config, method.module_class, selected, calibration, tokenizer, progress)
        data_free = data_free_config(config)
    converted += replace_linear_layers(model, data_free, method.module_class, selected, quantize=True)
    if not converted:
        raise_nothing_to_quantize(model, config)
    replace_vocabulary(model, config, quantize=True)  # the float embedding served calibration; now its turn
    _attach_hf_quantizer(model, config, quantizer_class_of(method))
    return model


def dequantize(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every quantized layer by a float `nn.Linear`, in place."""
    if hasattr(model, "hf_quantizer") and hasattr(model, "dequantize"):
        return model.dequantize(dtype=dtype)
    return dequantize_layers(model, dtype)


def _default_skips(model: nn.Module, config: QuantlabConfig) -> list[str]:
    if config.modules_to_not_convert is not None:
        return list(config.modules_to_not_convert)
    if hasattr(model, "all_tied_weights_keys") and hasattr(model, "get_output_embeddings"):
        return get_keys_to_not_convert(model)
    return []


def _check_targets(model: nn.Module, modules: list[str]) -> None:
    named = dict(model.named_modules())
    for name in modules:
        module = named.get(name)
        if module is None:
            raise QuantizationError(f"no module named {name!r} in {type(model).__name__}; check the name")
        if type(module) is not nn.Linear:
            raise QuantizationError(
                f"{name} is a {type(module).__name__}, not an nn.Linear layer: quantlab quantizes Linear layers "
                f"only; target its Linear sub-layers instead"
            )


def _attach_hf_quantizer(model: nn.Module, config: QuantlabConfig, quantizer_class: type) -> None:
    """Make a converted transformers model look like one loaded with `quantization_config`
    (its quantizer attached, and the chunked causal-LM loss that loading installs)."""
    if not hasattr(model, "config") or not hasattr(model, "save_pretrained"):
        return
    model.hf_quantizer = quantizer_class(config, pre_quantized=True)
    model.is_quantized = True
    model.quantization_method = config.quant_method
    model.config.quantization_config = config
    use_chunked_loss(model)
