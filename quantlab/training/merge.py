"""Merging a trained LoRA adapter into its base, with a report of what the merge costs.

Two ways:
- `merge_to_quantized`: each adapted layer's base is dequantized, `scaling * B @ A` added,
  and the sum re-quantized with the layer's own method and options (`QuantizedLoraLinear.merge`;
  PEFT does the same for bitsandbytes 4-bit). The result is a checkpoint of the same method
  and size, but the update now lies on the quantization grid: that rounding is the error the
  merge adds, and `merge_adapter` measures it as the perplexity change.
- `merge_to_float`: every quantized layer dequantized in place (`model.dequantize()`, or
  quantlab's `dequantize_layers` without a transformers quantizer), the update added to the
  float bases and PEFT's `unload()` taking the adapters off. The merged model computes the
  adapter model's function up to float rounding, and is a plain float checkpoint (quantize it
  again with any method).
"""

from typing import Any

import torch
from torch import nn

from quantlab.errors import QuantlabError
from quantlab.eval.perplexity import perplexity, token_ids
from quantlab.replacement import dequantize_layers

MODES = ("quantized", "float")


def merge_adapter(
    peft_model: nn.Module,
    tokenizer: Any,
    text: str,
    mode: str = "quantized",
    seq_len: int = 512,
    windows: int = 16,
) -> tuple[nn.Module, dict[str, Any]]:
    """Merge the adapter (`mode` "quantized" or "float") and report the perplexity before and after on `text`.

    The report: the mode, the adapter model's and the merged model's perplexity on the same
    windows, their relative change (`merged / adapter - 1`) and the largest logit gap.
    """
    if mode not in MODES:
        raise QuantlabError(f"merge mode {mode!r} is not valid; choose one of {', '.join(MODES)}")
    probe = torch.tensor(token_ids(tokenizer, text)[:seq_len]).unsqueeze(0)
    before = perplexity(peft_model, tokenizer, text, seq_len=seq_len, windows=windows)
    logits_before = _logits(peft_model, probe)
    merged = merge_to_quantized(peft_model) if mode == "quantized" else merge_to_float(peft_model)
    after = perplexity(merged, tokenizer, text, seq_len=seq_len, windows=windows)
    difference = float((_logits(merged, probe) - logits_before).abs().max())
    return merged, {
        "mode": mode,
        "perplexity_adapter": before,
        "perplexity_merged": after,
        "max_logit_difference": difference,
        "perplexity_change": after / before - 1,
    }


def merge_to_quantized(peft_model: nn.Module) -> nn.Module:
    """Merge into the quantized base (re-quantizing each adapted layer; QA-LoRA adapters move only the zero
    points); returns the unwrapped model."""
    _check_lora(peft_model)
    return peft_model.merge_and_unload()


def merge_to_float(peft_model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Dequantize every quantized layer, add the adapters to the float bases; returns the unwrapped model."""
    from peft.tuners.lora import LoraLayer  # PEFT is imported when it is used, not with quantlab.training

    _check_lora(peft_model)
    model = peft_model.get_base_model()
    adapted = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, module in adapted.items():
        if module.merged:
            raise QuantlabError(f"{name} already has a merged adapter; merge from the unmerged adapter model")
    if getattr(model, "hf_quantizer", None) is not None:
        _unpack_bitsandbytes_for_cpu(model)
        model.dequantize(dtype=dtype)
    else:
        dequantize_layers(model, dtype)
    with torch.no_grad():
        for module in adapted.values():
            weight = module.get_base_layer().weight
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight += module.get_delta_weight(adapter).to(weight.device, weight.dtype)
    model = peft_model.unload()
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model


def _unpack_bitsandbytes_for_cpu(model: nn.Module) -> None:
    """Undo bitsandbytes' CPU repacking, which its dequantization does not read.

    On CPU, bitsandbytes' first eval-mode forward repacks a 4-bit weight for a bf16 kernel, in
    place and for good; the repacking is undone here, but its bf16 absmax is what remains.
    """
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)


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
