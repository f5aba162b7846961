"""Merging a trained LoRA adapter into its base, with a report of what the merge costs.

Two ways:
- `merge_to_quantized`: each adapted layer's base is dequantized, `scaling * B @ A` added,
  and the sum re-quantized with the layer's own method and options (`QuantizedLoraLinear.merge`;
  PEFT does the same for bitsandbytes 4-bit). The result is a checkpoint of the same method
  and size, but the update now lies on the quantization grid: that rounding is the error the
  merge adds, and `merge_adapter` measures it as the perplexity change.
- `merge_to_float`: the same sum kept in float, every other quantized layer dequantized. The
  merged model computes the adapter model's function up to float rounding, and is a plain
  float checkpoint (quantize it again with any method).
"""

import dataclasses
from typing import Any

import torch
from torch import nn

from quantlab.errors import QuantlabError
from quantlab.nn import QuantizedLinear

MODES = ("quantized", "float")


@dataclasses.dataclass
class MergeReport:
    """Perplexity of the adapter model and of the merged one on the same windows, and their largest logit gap."""

    mode: str
    perplexity_adapter: float
    perplexity_merged: float
    max_logit_difference: float

    @property
    def perplexity_change(self) -> float:
        """Relative change, `merged / adapter - 1`."""
        return self.perplexity_merged / self.perplexity_adapter - 1

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "perplexity_change": self.perplexity_change}


def merge_adapter(
    peft_model: nn.Module,
    tokenizer: Any,
    text: str,
    mode: str = "quantized",
    seq_len: int = 512,
    windows: int = 16,
) -> tuple[nn.Module, MergeReport]:
    """Merge the adapter (`mode` "quantized" or "float") and report the perplexity before and after on `text`."""
    from quantlab.eval.perplexity import perplexity, token_ids

    if mode not in MODES:
        raise QuantlabError(f"merge mode {mode!r} is not valid; choose one of {', '.join(MODES)}")
    probe = torch.tensor(token_ids(tokenizer, text)[:seq_len]).unsqueeze(0)
    before = perplexity(peft_model, tokenizer, text, seq_len=seq_len, windows=windows)
    logits_before = _logits(peft_model, probe)
    merged = merge_to_quantized(peft_model) if mode == "quantized" else merge_to_float(peft_model)
    after = perplexity(merged, tokenizer, text, seq_len=seq_len, windows=windows)
    difference = float((_logits(merged, probe) - logits_before).abs().max())
    return merged, MergeReport(mode, before, after, difference)


def merge_to_quantized(peft_model: nn.Module) -> nn.Module:
    """Merge into the quantized base (re-quantizing each adapted layer); returns the unwrapped model."""
    _check_lora(peft_model)
    return peft_model.merge_and_unload()


def merge_to_float(peft_model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Merge into a float copy of each adapted layer and dequantize the rest; returns the unwrapped model."""
    from peft.tuners.lora import LoraLayer

    _check_lora(peft_model)
    model = peft_model.get_base_model()
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            if module.merged:
                raise QuantlabError(f"{name} already has a merged adapter; merge from the unmerged adapter model")
            _replace(model, name, _merged_linear(module, dtype))
    _dequantize_rest(model, dtype)
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model


def _merged_linear(layer: nn.Module, dtype: torch.dtype) -> nn.Linear:
    base = layer.get_base_layer()
    weight = float_weight(base)
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            weight = weight + layer.get_delta_weight(adapter).float().to(weight.device)
    bias = getattr(base, "bias", None)
    linear = nn.Linear(base.in_features, base.out_features, bias=bias is not None, device=weight.device, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias.detach())
    return linear.requires_grad_(False)


def float_weight(layer: nn.Module) -> torch.Tensor:
    """The float32 `[out, in]` weight of a float, quantlab or bitsandbytes Linear layer."""
    if isinstance(layer, QuantizedLinear):
        return layer.dequantize_weight(torch.float32)
    if type(layer) is nn.Linear:
        return layer.weight.detach().float()
    return _bitsandbytes_weight(layer)


def _bitsandbytes_weight(layer: nn.Module) -> torch.Tensor:
    """bitsandbytes' dequantized weight.

    On CPU, bitsandbytes' first eval-mode forward repacks a 4-bit weight for a bf16 kernel, in
    place and for good; the repacking is undone here, but its bf16 absmax is what remains.
    """
    from peft.utils.integrations import dequantize_module_weight

    weight = layer.weight
    state = getattr(weight, "quant_state", None)
    if getattr(state, "packing_format_for_cpu", False):
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
    return dequantize_module_weight(layer).float()


def _dequantize_rest(model: nn.Module, dtype: torch.dtype) -> None:
    """Dequantize the layers no adapter covered, and drop the model's quantization markers."""
    from quantlab.nn.quantized_embedding import QuantizedTable

    hf_quantizer = getattr(model, "hf_quantizer", None)
    if not any(_is_quantized_linear(module) or isinstance(module, QuantizedTable) for module in model.modules()):
        if hf_quantizer is not None:
            hf_quantizer.remove_quantization_config(model)
        return
    if hf_quantizer is not None and hasattr(model, "dequantize"):
        model.dequantize(dtype=dtype)
        return
    from quantlab.convert import dequantize_layers

    dequantize_layers(model, dtype)


def _is_quantized_linear(module: nn.Module) -> bool:
    """quantlab layers, and Linear subclasses that store quantized weights (bitsandbytes)."""
    return isinstance(module, QuantizedLinear) or (isinstance(module, nn.Linear) and type(module) is not nn.Linear)


def _check_lora(model: nn.Module) -> None:
    if not hasattr(model, "merge_and_unload") or not hasattr(model, "get_base_model"):
        raise QuantlabError(f"{type(model).__name__} has no LoRA adapter to merge; pass the PeftModel from add_lora")


def _logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            return model(input_ids=input_ids.to(next(model.parameters()).device)).logits.float().cpu()
    finally:
        model.train(was_training)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
