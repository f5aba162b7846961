"""Quantizing and dequantizing any loaded `nn.Module`, transformers model or not."""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.quantizers.base import get_keys_to_not_convert
from transformers.quantizers.quantizers_utils import should_convert_module

from quantlab.config import QuantlabConfig
from quantlab.errors import QuantizationError
from quantlab.nn import QuantizedLinear
from quantlab.solvers import get_solver
from quantlab.vocabulary import dequantize_vocabulary, replace_vocabulary, vocabulary_linears


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
    from quantlab.integrations.transformers import quantizer_class_of
    from quantlab.registry import method_of

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
    converted = []
    if config.needs_calibration:
        converted = calibrate(model, config, method.module_class, selected, calibration, tokenizer, progress)
    converted += replace_linear_layers(model, data_free_config(config), method.module_class, selected, quantize=True)
    if not converted:
        raise_nothing_to_quantize(model, config)
    replace_vocabulary(model, config, quantize=True)  # the float embedding served calibration; now its turn
    _attach_hf_quantizer(model, config, quantizer_class_of(method))
    return model


def calibrate(
    model: nn.Module,
    config: QuantlabConfig,
    module_class: type[QuantizedLinear],
    selected: Callable[[str], bool],
    calibration: torch.Tensor | list[str] | None,
    tokenizer: Any,
    progress: bool = True,
) -> list[str]:
    """Quantize the selected Linear layers inside the model's blocks with the calibrated solver."""
    from quantlab.calibration import calibration_windows, quantize_blocks
    from quantlab.calibration.data import windows_from_texts

    if config.self_calibration:
        if calibration is not None:
            raise QuantizationError(
                "self_calibration samples its own text; pass calibration=None or drop self_calibration"
            )
        from quantlab.calibration.self_generated import self_generated_windows

        windows = self_generated_windows(
            model, config.calibration_samples, config.calibration_seq_len, progress=progress
        )
    elif isinstance(calibration, torch.Tensor):
        windows = calibration.long()
    elif tokenizer is None:
        raise QuantizationError(
            f"the {config.solver} solver{' with awq' if config.awq else ''} calibrates on text: pass token ids "
            f"(calibration=tensor) or a tokenizer (tokenizer=...)"
        )
    elif calibration is not None:
        windows = windows_from_texts(tokenizer, calibration, config.calibration_samples, config.calibration_seq_len)
    else:
        windows = calibration_windows(
            tokenizer, config.calibration_samples, config.calibration_seq_len, config.calibration_text
        )
    if config.target_bits is not None:
        from quantlab.calibration.allocation import allocate_bits

        config.layer_options = allocate_bits(model, config, module_class, windows, selected, progress)
    if not (config.awq or get_solver(config.solver).needs_calibration):
        return []  # mixed precision with a data-free solver: the layers are quantized as usual next
    return quantize_blocks(model, config, module_class, windows, selected, progress)


def data_free_config(config: QuantlabConfig) -> QuantlabConfig:
    """The config for layers quantized without statistics: all of them under a data-free solver, and
    under a calibrated one those outside the calibrated blocks (an untied output head, a pooler),
    which get the data-free mse solver on the same storage format."""
    if not config.needs_calibration:
        return config
    solver = "mse" if get_solver(config.solver).needs_calibration else config.solver
    options = config.solver_options if solver == config.solver else None
    return dataclasses.replace(
        config, solver=solver, solver_options=options, awq=False, target_bits=None, self_calibration=False
    )


def without_vocabulary(
    model: nn.Module, config: QuantlabConfig, selected: Callable[[str], bool]
) -> Callable[[str], bool]:
    """`selected` less the output head when `embedding_bits` quantizes it as a vocabulary table."""
    tables = vocabulary_linears(model, config)
    if not tables:
        return selected
    return lambda name: name not in tables and selected(name)


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


def dequantize(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every quantized layer by a float `nn.Linear`, in place."""
    if hasattr(model, "hf_quantizer") and hasattr(model, "dequantize"):
        return model.dequantize(dtype=dtype)
    return dequantize_layers(model, dtype)


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
        _set_submodule(model, name, new)
        converted.append(name)
    return converted


def dequantize_layers(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    dequantize_vocabulary(model, dtype)
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            _set_submodule(model, name, module.to_linear(dtype))
    for attribute in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attribute):
            delattr(model, attribute)
    if hasattr(model, "config") and hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    return model


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


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
    from quantlab.integrations.chunked_loss import use_chunked_loss

    if not hasattr(model, "config") or not hasattr(model, "save_pretrained"):
        return
    model.hf_quantizer = quantizer_class(config, pre_quantized=True)
    model.is_quantized = True
    model.quantization_method = config.quant_method
    model.config.quantization_config = config
    use_chunked_loss(model)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
