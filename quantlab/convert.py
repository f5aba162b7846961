"""Quantizing and dequantizing any loaded `nn.Module`, transformers model or not."""

from typing import Any

import torch
from torch import nn

from quantlab.config import QuantlabConfig
from quantlab.integrations.chunked_loss import use_chunked_loss
from quantlab.integrations.transformers import quantizer_class_of
from quantlab.plan import QuantizationPlan, build_plan, quantize_loaded
from quantlab.registry import method_of
from quantlab.replacement import dequantize_layers


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
    plan = build_plan(model, config, modules)
    plan.warn()
    quantize_loaded(model, plan, calibration, tokenizer, progress)
    _attach_hf_quantizer(model, plan, quantizer_class_of(method))
    return model


def dequantize(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every quantized layer by a float `nn.Linear`, in place."""
    if hasattr(model, "hf_quantizer") and hasattr(model, "dequantize"):
        return model.dequantize(dtype=dtype)
    return dequantize_layers(model, dtype)


def _attach_hf_quantizer(model: nn.Module, plan: QuantizationPlan, quantizer_class: type) -> None:
    """Make a converted transformers model look like one loaded with `quantization_config`
    (its quantizer attached, holding the plan it ran, and the chunked causal-LM loss that loading installs)."""
    if not hasattr(model, "config") or not hasattr(model, "save_pretrained"):
        return
    config = plan.config
    model.hf_quantizer = quantizer_class(config, pre_quantized=True)
    model.hf_quantizer.plan = plan
    model.is_quantized = True
    model.quantization_method = config.quant_method
    model.config.quantization_config = config
    use_chunked_loss(model)
