"""`QuantizedExperts`: a mixture of experts' fused projections, stored quantized expert by expert.

transformers 5 keeps a mixture of experts' MLPs as one module holding two 3-D parameters,
`gate_up_proj` `[experts, 2 * intermediate, hidden]` and `down_proj` `[experts, hidden,
intermediate]` (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, OLMoE, ...). This module replaces
such a module: each expert's slice of each projection is quantized exactly as a `QuantizedLinear`
of the method would store it (the same codec, layout and solver), and the slices are stacked
along a leading expert dimension. The codes keep the float parameter's name (`gate_up_proj`,
now `[experts, out, groups, bytes]`), the other stored tensors are named after it
(`gate_up_proj_scale`, ...), so transformers' own checkpoint conversions (per-expert tensors in
the file, fused in memory) apply to the codes as they do to float weights.

The forward pass routes like transformers' eager experts: each expert that received tokens runs
its two projections on those tokens only, through the kernel of its format (`ExpertSlice` shows
one expert's slice to a kernel as a quantized Linear layer), and the weighted results are summed.
Each projection is one call of `quantlab.kernels.experts.routed_linear` (as the operator
`quantlab::routed_linear` without gradients), so torch.compile traces the whole module into one
graph: the activation between the projections and everything around them as torch operations.
"""

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from quantlab.config import QuantlabConfig
from quantlab.kernels.experts import ExpertSlice, layout_text, routed_linear, routed_linear_op
from quantlab.nn.kinds import fused_experts_shape
from quantlab.nn.quantized_linear import QuantizedLinear
from quantlab.nn.stored import StoredTensorsModule

PROJECTIONS = ("gate_up_proj", "down_proj")


class QuantizedExperts(StoredTensorsModule):
    """The experts of one mixture-of-experts layer, each projection stored in the format of `layer_class`."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act_fn: nn.Module,
        layer_class: type[QuantizedLinear],
        configs: dict[str, QuantlabConfig],
        float_class: type[nn.Module] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.act_fn = act_fn
        self.layer_class = layer_class
        self.configs = dict(configs)
        self.float_class = float_class  # what `to_float` rebuilds, with these attributes (flags, config)
        self.float_attributes: dict[str, Any] = {}
        shapes = {"gate_up_proj": (2 * intermediate_size, hidden_size), "down_proj": (hidden_size, intermediate_size)}
        self.layouts = {
            projection: layer_class.layout_for(inputs, outputs, self.configs[projection])
            for projection, (outputs, inputs) in shapes.items()
        }
        for projection, layout in self.layouts.items():
            for name, spec in layout.tensors.items():
                shape = (num_experts, *spec.shape)
                self.register_buffer(stored_name(projection, name), torch.zeros(shape, dtype=spec.dtype, device=device))
        self._projection_names = {
            projection: tuple(stored_name(projection, name) for name in layout.tensors)
            for projection, layout in self.layouts.items()
        }
        self.stored_names = tuple(name for names in self._projection_names.values() for name in names)
        self._layout_texts = {projection: layout_text(layout) for projection, layout in self.layouts.items()}
        self._slices: dict[str, list[ExpertSlice]] = {}
        self._sliced_from: tuple[int, ...] = ()

    # -- built from a float experts module -----------------------------------------------------

    @classmethod
    def empty_like(
        cls, experts: nn.Module, layer_class: type[QuantizedLinear], configs: dict[str, QuantlabConfig]
    ) -> "QuantizedExperts":
        """An empty module standing in for the float `experts` (on its device: meta while transformers loads)."""
        num_experts, hidden, intermediate = fused_experts_shape(experts)
        device = experts.gate_up_proj.device
        module = cls(num_experts, hidden, intermediate, experts.act_fn, layer_class, configs, type(experts), device)
        module.float_attributes = {key: value for key, value in vars(experts).items() if not key.startswith("_")}
        return module

    @classmethod
    def from_float(
        cls, experts: nn.Module, layer_class: type[QuantizedLinear], configs: dict[str, QuantlabConfig], name: str
    ) -> "QuantizedExperts":
        """Quantize every expert of the float `experts` module (named `name`) with the configs' data-free solver."""
        module = cls.empty_like(experts, layer_class, configs)
        for projection in PROJECTIONS:
            stored = module.quantize_projection(projection, getattr(experts, projection), f"{name}.{projection}")
            module.load_stored(stored)
        return module

    def quantize_projection(self, projection: str, weight: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        """The stacked stored tensors (by buffer name) of the float `[experts, out, in]` weight of `projection`."""
        config = self.configs[projection]
        slices = [
            self.layer_class.quantize_checked(weight[expert], config, f"{name}.{expert}")
            for expert in range(weight.shape[0])
        ]
        return stack_slices(projection, slices)

    def load_stored(self, stored: dict[str, torch.Tensor]) -> None:
        for name, tensor in stored.items():
            setattr(self, name, tensor.to(getattr(self, name).device))

    # -- the stored tensors ------------------------------------------------------------------------

    def stored_tensor_names(self) -> tuple[str, ...]:
        return self.stored_names

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.stored_names}

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored_tensors().values())

    @property
    def in_features(self) -> int:  # read by reports counting the weights a module encodes
        return self.hidden_size

    @property
    def out_features(self) -> int:
        return 3 * self.intermediate_size * self.num_experts

    def slices(self, projection: str) -> list[ExpertSlice]:
        """Each expert's slice of `projection` (rebuilt when a stored tensor was replaced)."""
        source = tuple(id(self._buffers[name]) for name in self.stored_names)
        if source != self._sliced_from:
            self._slices = {
                p: [ExpertSlice(layout, self._expert_tensors(p, e)) for e in range(self.num_experts)]
                for p, layout in self.layouts.items()
            }
            self._sliced_from = source
        return self._slices[projection]

    def _expert_tensors(self, projection: str, expert: int) -> dict[str, torch.Tensor]:
        return {name: self._buffers[stored_name(projection, name)][expert] for name in self.layouts[projection].tensors}

    def dequantize_projection(self, projection: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float `[experts, out, in]` weight the stored tensors of `projection` represent."""
        return torch.stack([expert.dequantize_stored(dtype) for expert in self.slices(projection)])

    def to_float(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The float experts module (the class this one replaced) with the dequantized weights."""
        if self.float_class is None:
            raise TypeError("this QuantizedExperts does not know the float class it replaced")
        experts = self.float_class.__new__(self.float_class)
        nn.Module.__init__(experts)
        for name, value in self.float_attributes.items():
            setattr(experts, name, value)
        experts.act_fn = self.act_fn
        for projection in PROJECTIONS:
            setattr(experts, projection, nn.Parameter(self.dequantize_projection(projection, dtype)))
        return experts

    # -- the forward pass ----------------------------------------------------------------------------

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        gate, up = self.project("gate_up_proj", hidden_states, top_k_index).chunk(2, dim=-1)
        return self.project("down_proj", self.act_fn(gate) * up, top_k_index, top_k_weights)

    def project(
        self, projection: str, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`routed_linear` of one projection: each routed pair's row `[tokens, k, out]`, or with `top_k_weights`
        the weighted sum per token `[tokens, out]`. Without gradients it runs as the operator
        `quantlab::routed_linear`, which torch.compile keeps in the graph; with them, the same function
        directly, its gradients flowing through the kernels."""
        layout, stored = self.routed_arguments(projection)
        if torch.is_grad_enabled() and (x.requires_grad or (top_k_weights is not None and top_k_weights.requires_grad)):
            return routed_linear(x, top_k_index, top_k_weights, self.layouts[projection], stored)
        return routed_linear_op(x, top_k_index, top_k_weights, layout, stored)

    def routed_arguments(self, projection: str) -> tuple[str, list[torch.Tensor]]:
        """What `quantlab::routed_linear` takes for `projection` after the routing: its layout in one line
        (`layout_text`) and its stacked stored tensors in the layout's order."""
        return self._layout_texts[projection], [self._buffers[name] for name in self._projection_names[projection]]

    def extra_repr(self) -> str:
        layout = self.layouts["gate_up_proj"]
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, format={layout.codec} {layout.bits}-bit"
        )


def stored_name(projection: str, tensor: str) -> str:
    """The buffer of one stored tensor of a projection: the codes keep the projection's name, the others are named
    after it (`weight_scale` of `down_proj` is `down_proj_scale`)."""
    return projection if tensor == "weight" else f"{projection}_{tensor.removeprefix('weight_')}"


def stack_slices(projection: str, slices: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One projection's per-expert stored tensors (as `QuantizedLinear.quantize_checked` makes them), stacked."""
    return {stored_name(projection, name): torch.stack([s[name] for s in slices]) for name in slices[0]}


def routed_tokens(top_k_index: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, token indices, top-k positions) for each expert that received tokens, in expert order."""
    with torch.no_grad():
        experts = torch.unique(top_k_index)
    for expert in experts.tolist():
        if 0 <= expert < num_experts:
            tokens, positions = torch.where(top_k_index == expert)
            yield expert, tokens, positions


def expert_configs(config: QuantlabConfig, name: str) -> dict[str, QuantlabConfig]:
    """The config of each projection of the experts module `name` (its `layer_options` applied; never rotated:
    the experts' inputs are not)."""
    return {projection: unrotated(config.config_for(f"{name}.{projection}")) for projection in PROJECTIONS}


def unrotated(config: QuantlabConfig) -> QuantlabConfig:
    """`config` for an experts projection: never rotated, since `QuantizedExperts` does not rotate its inputs."""
    return dataclasses.replace(config, input_rotated=False) if config.input_rotated else config
