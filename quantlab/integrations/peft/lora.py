"""The LoRA layer PEFT puts around a quantlab `QuantizedLinear` (QLoRA, arXiv 2305.14314).

`y = base(x) + B(A(dropout(x))) * scaling`: the quantized base stays frozen (its tensors are
buffers) and its forward goes through quantlab's kernel table, whose autograd path
re-dequantizes in the backward pass instead of keeping a float weight per layer. Only `A`
and `B` train.

Merging dequantizes the base, adds `scaling * B @ A` and re-quantizes with the layer's own
method and options, so the merged model is a checkpoint of the same method; the rounding of
that last step is the error a merge adds, measured and reported as a `RequantizationWarning`
(`quantlab.integrations.peft.merge`).
Imported lazily by `quantlab.integrations.peft`, because it needs PEFT itself.
"""

import warnings
from typing import Any

import torch
from peft.tuners.lora import LoraConfig, LoraLayer
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn

from quantlab.errors import QuantlabError
from quantlab.integrations.peft.merge import record_rounding
from quantlab.nn import QuantizedLinear


class QuantizedLoraLinear(nn.Module, LoraLayer):
    """LoRA adapters on a frozen quantlab `QuantizedLinear` of any method."""

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: LoraConfig,
        r: int = 0,
        lora_alpha: int = 1,
        **kwargs: Any,
    ) -> None:
        unsupported = [name for name in ("use_dora", "lora_bias") if getattr(config, name, False)] + (
            ["velora_config"] if getattr(config, "velora_config", None) is not None else []
        )
        if unsupported:
            raise QuantlabError(
                f"LoRA on quantlab layers does not support {', '.join(unsupported)}; "
                f"use plain LoRA (set {', '.join(unsupported)} off)"
            )
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    # -- forward ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        adapter_names = kwargs.pop("adapter_names", None)
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if adapter_names is not None:
            return self._mixed_batch_forward(x, *args, adapter_names=adapter_names, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        for adapter in self.active_adapters:
            if adapter in self.lora_A:
                result = result + self._lora_output(adapter, x).to(result.dtype)
        return result

    def _mixed_batch_forward(
        self, x: torch.Tensor, *args: Any, adapter_names: list[str], **kwargs: Any
    ) -> torch.Tensor:
        """Each row of the batch through its own adapter (`"__base__"`: none); inference only."""
        result = self.base_layer(x, *args, **kwargs)
        for adapter in set(adapter_names):
            if adapter == "__base__" or adapter not in self.lora_A:
                continue
            rows = [i for i, name in enumerate(adapter_names) if name == adapter]
            result[rows] += self._lora_output(adapter, x[rows]).to(result.dtype)
        return result

    def _lora_output(self, adapter: str, x: torch.Tensor) -> torch.Tensor:
        lora_A, lora_B = self.lora_A[adapter], self.lora_B[adapter]
        if not torch.is_autocast_enabled(x.device.type):
            x = self._cast_input_dtype(x, lora_A.weight.dtype)
        return lora_B(lora_A(self.lora_dropout[adapter](x))) * self.scaling[adapter]

    # -- merging ----------------------------------------------------------------------------

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """`scaling * B @ A`, the float `[out, in]` update this adapter adds to the weight."""
        weight_A = self.lora_A[adapter].weight.float()
        weight_B = self.lora_B[adapter].weight.float()
        return (weight_B @ weight_A) * self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the adapters to the base weight and re-quantize it with the layer's method."""
        adapters = [name for name in check_adapters_to_merge(self, adapter_names) if name in self.lora_A]
        if not adapters:
            return
        base = self.get_base_layer()
        weight = base.dequantize_weight(torch.float32)
        with torch.no_grad():
            update = sum(self.get_delta_weight(adapter).to(weight.device) for adapter in adapters)
            weight = weight + update
        if safe_merge and not torch.isfinite(weight).all():
            raise QuantlabError(f"merging adapter(s) {adapters} gives NaN/Inf weights: the adapter is broken")
        self.base_layer = requantized_like(base, weight)
        self.merged_adapters.extend(adapters)
        merged = self.base_layer.dequantize_weight(torch.float32)
        record_rounding(self, base.config.method, weight, update, merged)

    def unmerge(self) -> None:
        """Subtract merged adapters again; the base is re-quantized, so it does not return bit-exactly."""
        if not self.merged:
            warnings.warn("the LoRA layer has no merged adapter; nothing to unmerge", UserWarning, stacklevel=2)
            return
        base = self.get_base_layer()
        weight = base.dequantize_weight(torch.float32)
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            if adapter in self.lora_A:
                weight = weight - self.get_delta_weight(adapter).to(weight.device)
        self.base_layer = requantized_like(base, weight)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def requantized_like(layer: QuantizedLinear, weight: torch.Tensor) -> QuantizedLinear:
    """A new layer of `layer`'s class and config holding `weight` quantized; the bias is kept."""
    bias = layer.bias
    new = type(layer)(
        layer.in_features,
        layer.out_features,
        bias is not None,
        layer.config,
        dtype=bias.dtype if bias is not None else torch.float32,
        device=weight.device,
    )
    new.load_stored(type(layer).quantize_checked(weight, layer.config, type(layer).__name__))
    if bias is not None:
        new.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
    new.train(layer.training)
    return new
