"""The LoRA layer PEFT puts around a quantlab `QuantizedLinear` (QLoRA, arXiv 2305.14314).

`y = base(x) + B(A(dropout(x))) * scaling`: the quantized base stays frozen (its tensors are
buffers) and its forward goes through quantlab's kernel table, whose autograd path
re-dequantizes in the backward pass instead of keeping a float weight per layer. Only `A`
and `B` train.

Merging dequantizes the base, adds `scaling * B @ A` and re-quantizes with the layer's own
method and options, so the merged model is a checkpoint of the same method; the rounding of
that last step is the error a merge adds, measured and reported as a `RequantizationWarning`
(`quantlab.integrations.peft.merge`).

QA-LoRA (Xu et al., arXiv 2309.14717; PEFT's `LoraConfig(use_qalora=True, qalora_group_size=G)`):
`A` reads the input averaged over each run of `G` features (times `in / G`, as PEFT computes
it), so the update is one number per output row and run of `G` inputs. Where `G` is a multiple
of the layer's quantization group and the layout stores zero points (`custom_bits` with
`symmetric=False`), a constant per group is a shift of the group's zero point: merging keeps
every code and scale and moves only the zero points (rounded to their stored dtype), so the
merged layer is as small and as fast as before, and computes what the adapter did up to that
rounding.
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
        if getattr(config, "use_qalora", False):
            check_qalora(base_layer, config.qalora_group_size)
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def resolve_lora_variant(self, *, config: LoraConfig, **kwargs: Any) -> Any:
        """PEFT's QA-LoRA variant (its `lora_A` of `in / G` inputs) when `use_qalora`; plain LoRA otherwise."""
        if not getattr(config, "use_qalora", False):
            return None
        from peft.tuners.lora.variants import QALoraLinearVariant

        return QALoraLinearVariant()

    def _qalora_group(self, adapter: str) -> int | None:
        """The input run an adapter's `A` pools over (QA-LoRA), or None for plain LoRA."""
        return getattr(self, "qalora_group_size", {}).get(adapter) if adapter in self.lora_variant else None

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
        x = self.lora_dropout[adapter](x)
        group = self._qalora_group(adapter)
        if group is not None:  # QA-LoRA: each run of `group` inputs averaged, times the number of runs (PEFT's)
            x = x.unflatten(-1, (-1, group)).mean(dim=-1) * (self.in_features // group)
        return lora_B(lora_A(x)) * self.scaling[adapter]

    # -- merging ----------------------------------------------------------------------------

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """`scaling * B @ A`, the float `[out, in]` update this adapter adds to the weight (QA-LoRA: one
        value per run of pooled inputs, repeated over the run)."""
        with torch.no_grad():
            update = (self.lora_B[adapter].weight.float() @ self.lora_A[adapter].weight.float()) * self.scaling[adapter]
            group = self._qalora_group(adapter)
            if group is not None:
                update = (update * (self.in_features // group) / group).repeat_interleave(group, dim=1)
        return update

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the adapters to the base weight: QA-LoRA adapters into the zero points (codes and scales
        kept), others by re-quantizing the sum with the layer's method."""
        adapters = [name for name in check_adapters_to_merge(self, adapter_names) if name in self.lora_A]
        if not adapters:
            return
        base = self.get_base_layer()
        weight = base.dequantize_weight(torch.float32)
        update = sum(self.get_delta_weight(adapter).to(weight.device) for adapter in adapters)
        weight = weight + update
        if safe_merge and not torch.isfinite(weight).all():
            raise QuantlabError(f"merging adapter(s) {adapters} gives NaN/Inf weights: the adapter is broken")
        self.merged_adapters.extend(adapters)
        if all(self._qalora_group(adapter) is not None for adapter in adapters):
            self.base_layer = zero_points_shifted(base, update)  # nothing re-quantized: no rounding to report
            return
        self.base_layer = requantized_like(base, weight)
        merged = self.base_layer.dequantize_weight(torch.float32)
        record_rounding(self, base.config.method, weight, update, merged)

    def unmerge(self) -> None:
        """Subtract merged adapters again: QA-LoRA ones from the zero points, others by re-quantizing
        (which does not return bit-exactly)."""
        if not self.merged:
            warnings.warn("the LoRA layer has no merged adapter; nothing to unmerge", UserWarning, stacklevel=2)
            return
        base = self.get_base_layer()
        adapters = [adapter for adapter in self.merged_adapters if adapter in self.lora_A]
        self.merged_adapters.clear()
        update = sum(self.get_delta_weight(adapter).to(base.weight.device) for adapter in adapters)
        if all(self._qalora_group(adapter) is not None for adapter in adapters):
            self.base_layer = zero_points_shifted(base, -update)
        else:
            self.base_layer = requantized_like(base, base.dequantize_weight(torch.float32) - update)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def check_qalora(layer: nn.Module, group: int) -> None:
    """QuantlabError unless a QA-LoRA update pooled over runs of `group` inputs merges into `layer`'s zero points."""
    if not isinstance(layer, QuantizedLinear):
        return
    layout = layer.layout
    if not layout.has_zero:
        raise QuantlabError(
            f"QA-LoRA merges into zero points, and this {layer.config.method} layer stores none; quantize with "
            f"zero points (custom_bits with symmetric=False), or use plain LoRA"
        )
    if layer.in_features % group or group % layout.group_length:
        raise QuantlabError(
            f"QA-LoRA's qalora_group_size={group} must divide the layer's {layer.in_features} inputs and be a "
            f"multiple of its quantization group ({layout.group_length}); use qalora_group_size={layout.group_length}"
        )


def zero_points_shifted(layer: QuantizedLinear, update: torch.Tensor) -> QuantizedLinear:
    """A new layer like `layer` whose weight is `layer`'s plus `update`, an `[out, in]` update constant on
    each quantization group, taken into the zero points (`w = (q - zero) * scale`): codes and scales stay."""
    layout = layer.layout
    codes, params = layer.codes_and_params()
    per_group = update[:, :: layout.group_length].to(params.scale.device)  # each group's (constant) value
    shifted = layout.grid(
        params.scale, torch.where(params.scale == 0, params.zero, params.zero - per_group / params.scale)
    )
    new = type(layer)(layer.in_features, layer.out_features, layer.bias is not None, layer.config, device=codes.device)
    new.load_stored(layout.store(codes, shifted))
    new.bias = layer.bias
    new.train(layer.training)
    return new


def requantized_like(layer: QuantizedLinear, weight: torch.Tensor) -> QuantizedLinear:
    """A new layer of `layer`'s class and config holding `weight` quantized (a calibrated solver's layer by
    the data-free solver on the same format: no calibration data is at hand); the bias is kept."""
    from quantlab.plan import data_free_config

    bias = layer.bias
    new = type(layer)(
        layer.in_features,
        layer.out_features,
        bias is not None,
        layer.config,
        dtype=bias.dtype if bias is not None else torch.float32,
        device=weight.device,
    )
    new.load_stored(type(layer).quantize_checked(weight, data_free_config(layer.config), type(layer).__name__))
    if bias is not None:
        new.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
    new.train(layer.training)
    return new
