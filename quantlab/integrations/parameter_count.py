"""Counting quantized weights as the parameters they stand for.

A quantized layer stores its weight as buffers (packed codes and scales), so
`PreTrainedModel.num_parameters()` and PEFT's `print_trainable_parameters()` would count only
the float parameters left (28.3 M of SmolLM2-135M's 134.5 M) and report a trainable share
four times too high. transformers and PEFT special-case bitsandbytes' `Params4bit` the same
way; neither has a hook for other layers, so their counting methods are wrapped: each quantized
`[out, in]` weight adds `out * in` frozen parameters. `get_memory_footprint()` already counts
the stored bytes (they are buffers); with `return_buffers=False` they are added too, as
bitsandbytes' weights are.
"""

from collections.abc import Callable
from typing import Any

from torch import nn

from quantlab.integrations.patching import wrap
from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_embedding import QuantizedOutputHead, QuantizedTable


def quantized_weight_count(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Elements of the float weights that `model`'s quantized layers and vocabulary tables stand for
    (each once: a tied head stores none, as a tied float head adds no parameter)."""
    kinds = (QuantizedLinear, QuantizedOutputHead) if exclude_embeddings else (QuantizedLinear, QuantizedTable)
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, kinds))


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes the quantized layers and tables store for their weights (codes, scales, zero points)."""
    return sum(m.stored_bytes() for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedTable)))


def patch_transformers_counts(modeling_utils: Any) -> None:
    """Make `num_parameters` and `get_memory_footprint` of every transformers model count quantized weights."""
    model_class = modeling_utils.PreTrainedModel
    wrap(model_class, "num_parameters", _num_parameters)
    wrap(model_class, "get_memory_footprint", _get_memory_footprint)


def patch_peft_counts(peft_model: Any) -> None:
    """Make `PeftModel.get_nb_trainable_parameters` (and `print_trainable_parameters`) count quantized weights."""
    wrap(peft_model.PeftModel, "get_nb_trainable_parameters", _get_nb_trainable_parameters)


def patch_peft_mixed_counts(mixed_model: Any) -> None:
    wrap(mixed_model.PeftMixedModel, "get_nb_trainable_parameters", _get_nb_trainable_parameters)


def _num_parameters(original: Callable[..., int]) -> Callable[..., int]:
    def num_parameters(self: nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        count = original(self, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
        if only_trainable:
            return count  # quantized weights never train
        return count + quantized_weight_count(self, exclude_embeddings)

    return num_parameters


def _get_memory_footprint(original: Callable[..., int]) -> Callable[..., int]:
    def get_memory_footprint(self: nn.Module, return_buffers: bool = True) -> int:
        footprint = original(self, return_buffers=return_buffers)
        return footprint if return_buffers else footprint + quantized_weight_bytes(self)

    return get_memory_footprint


def _get_nb_trainable_parameters(original: Callable[..., tuple[int, int]]) -> Callable[..., tuple[int, int]]:
    def get_nb_trainable_parameters(self: nn.Module) -> tuple[int, int]:
        trainable, total = original(self)
        return trainable, total + quantized_weight_count(self)

    return get_nb_trainable_parameters
