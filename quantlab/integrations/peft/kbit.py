"""`peft.prepare_model_for_kbit_training` treats a quantlab model as the k-bit model it is.

PEFT freezes every parameter and casts fp16/bf16 ones to fp32 for any model, but turns on
gradient checkpointing (and input gradients, for reentrant checkpointing) only for models it
recognises: bitsandbytes' `is_loaded_in_4bit`/`is_loaded_in_8bit` flags or a fixed list of
`quantization_method` names. quantlab cannot raise those flags without promising
bitsandbytes (transformers imports it to count a 4-bit model's parameters), so the function
is wrapped: on a model holding quantlab layers the wrapper finishes what PEFT does for
bitsandbytes, with the same arguments and defaults.
"""

from collections.abc import Callable
from typing import Any

from torch import nn

from quantlab.integrations.patching import wrap
from quantlab.nn import QuantizedLinear


def patch_prepare_model_for_kbit_training(peft_utils_other: Any) -> None:
    wrap(peft_utils_other, "prepare_model_for_kbit_training", _finish_for_quantlab)


def _finish_for_quantlab(original: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def prepare_model_for_kbit_training(
        model: nn.Module,
        use_gradient_checkpointing: bool = True,
        gradient_checkpointing_kwargs: dict[str, Any] | None = None,
        auto_clear_cache: bool = True,
    ) -> nn.Module:
        model = original(model, use_gradient_checkpointing, gradient_checkpointing_kwargs, auto_clear_cache)
        if use_gradient_checkpointing and not _is_checkpointing(model) and _has_quantized_layers(model):
            _enable_checkpointing(model, dict(gradient_checkpointing_kwargs or {}))
        return model

    return prepare_model_for_kbit_training


def _enable_checkpointing(model: nn.Module, options: dict[str, Any]) -> None:
    """PEFT's k-bit branch: input gradients unless checkpointing is non-reentrant, then checkpointing."""
    if options.get("use_reentrant", True):
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
        else:
            model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.requires_grad_(True))
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23; the older name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def _has_quantized_layers(model: nn.Module) -> bool:
    return any(isinstance(module, QuantizedLinear) for module in model.modules())


def _is_checkpointing(model: nn.Module) -> bool:
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if isinstance(getattr(type(model), name, None), property):
            return bool(getattr(model, name))
    return False
