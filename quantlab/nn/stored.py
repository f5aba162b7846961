"""What every module holding quantized tensors does with them: keep their dtype, refuse float weights."""

from typing import Any

import torch
from torch import nn

from quantlab.errors import QuantizationError


class StoredTensorsModule(nn.Module):
    """Base of the quantized modules: `stored_tensor_names()` are the buffers that hold codes and scales."""

    def stored_tensor_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _apply(self, fn: Any, recurse: bool = True) -> "StoredTensorsModule":
        # `model.half()` / `.to(bfloat16)` cast every float buffer; the stored tensors must
        # keep their dtype (a float32 scale rounded to bf16 and back changes the model), so
        # they only follow device moves. Codes and scales are moved, never converted.
        stored = {name: self._buffers.pop(name) for name in self.stored_tensor_names()}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, tensor in stored.items():
                device = fn(torch.empty(0, device=tensor.device)).device
                self._buffers[name] = tensor if tensor.device == device else tensor.to(device)
        return self

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # Buffers loaded through `load_state_dict` must keep their shapes: a float `weight`
        # here means someone loads an unquantized state dict into a quantized model.
        weight = state_dict.get(prefix + "weight")
        if weight is not None and weight.is_floating_point():
            raise QuantizationError(
                f"{prefix[:-1]}: got a float weight for a quantized module; quantize the float model with "
                f"quantlab.quantize(model, config) instead of loading its state dict into a quantized one"
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
