"""Calibrating a mixture of experts: every expert's statistics from the tokens routed to it.

A fused float experts module (transformers 5: two 3-D parameters) is replaced, while its block is
calibrated, by `UnfusedExperts`: the same routing, with each expert's slice of each projection an
`nn.Linear` whose weight is a view of the fused parameter (no copy). Every calibrated solver then
treats each expert slice as the Linear layer it is (its own input statistics, GPTQ, reconstruction),
and `fuse_experts` stacks the quantized slices into a `QuantizedExperts` before the block is stored.

`expert_calibration="routed"` (the default) gives each expert the tokens the router sends it; an
expert that receives fewer than `MIN_EXPERT_TOKENS` is quantized by the data-free solver instead
and named in a warning and in the plan's notes. `"all"` runs every expert on every token for its
statistics (llm-compressor's and ModelOpt's "calibrate all experts"), while each token's output
still comes from its routed experts only, so the block's outputs are those of the real routing.

Mixed precision measures the slices the same way (`unfuse_experts`, then `restore_experts`), and
`slice_hooks` lets a whole-model pass (the empirical Fisher's backward) see each slice's output.
"""

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from quantlab.errors import DataFreeExpertsWarning
from quantlab.nn import QuantizedLinear
from quantlab.nn.kinds import fused_experts_shape, is_fused_experts
from quantlab.nn.quantized_experts import PROJECTIONS, QuantizedExperts, routed_tokens, stack_slices
from quantlab.solvers import InputStats

if TYPE_CHECKING:
    from quantlab.plan import QuantizationPlan

# Fewer routed tokens than this and an expert's input statistics say little: GPTQ would fit noise.
MIN_EXPERT_TOKENS = 16


class UnfusedExperts(nn.Module):
    """A fused float experts module with each expert's projections as `nn.Linear` views, routing as it does."""

    def __init__(self, experts: nn.Module, every_token: bool) -> None:
        super().__init__()
        self.fused = [experts]  # a list: not a submodule, so its parameters are not the block's twice
        self.num_experts, _, _ = fused_experts_shape(experts)
        self.act_fn = experts.act_fn
        self.every_token = every_token
        for projection in PROJECTIONS:
            weight = getattr(experts, projection)
            setattr(self, projection, nn.ModuleList(_linear_view(weight[e]) for e in range(self.num_experts)))
        self.routed = torch.zeros(self.num_experts, dtype=torch.long)  # tokens routed to each expert

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        for expert, tokens, positions in routed_tokens(top_k_index, self.num_experts):
            self.routed[expert] += tokens.numel()
            inputs = hidden_states if self.every_token else hidden_states[tokens]
            gate, up = self.gate_up_proj[expert](inputs).chunk(2, dim=-1)
            out = self.down_proj[expert](self.act_fn(gate) * up)
            if self.every_token:
                out = out[tokens]
            final.index_add_(0, tokens, (out * top_k_weights[tokens, positions, None]).to(final.dtype))
        if self.every_token:  # experts no token chose still see every token
            chosen = set(torch.unique(top_k_index).tolist())
            for expert in range(self.num_experts):
                if expert not in chosen:
                    gate, up = self.gate_up_proj[expert](hidden_states).chunk(2, dim=-1)
                    self.down_proj[expert](self.act_fn(gate) * up)
        return final


def _linear_view(weight: torch.Tensor) -> nn.Linear:
    """An `nn.Linear` whose weight is `weight` itself (a slice of the fused parameter), without a bias."""
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.out_features, linear.in_features = weight.shape
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = None
    return linear


def unfuse_experts(block: nn.Module, prefix: str, plan: "QuantizationPlan") -> dict[str, UnfusedExperts]:
    """Replace the planned fused experts modules of `block` (named `prefix` in the model) by `UnfusedExperts`;
    returns them by their name in the block."""
    planned = set(plan.experts_modules)
    every_token = plan.config.expert_calibration == "all"
    unfused = {}
    for relative, module in list(block.named_modules()):
        if f"{prefix}.{relative}" in planned and is_fused_experts(module):
            unfused[relative] = UnfusedExperts(module, every_token)
            block.set_submodule(relative, unfused[relative])
    return unfused


def restore_experts(block: nn.Module, unfused: dict[str, UnfusedExperts]) -> None:
    """Put the float fused experts modules back in place of their `UnfusedExperts` (after measuring a block)."""
    for relative, module in unfused.items():
        block.set_submodule(relative, module.fused[0])


def expert_slice(model: nn.Module, name: str) -> tuple[str, str, int] | None:
    """(experts module, projection, expert) of an expert slice name `{experts}.{projection}.{expert}` of a fused
    experts module of `model`, or None for any other name."""
    rest, _, index = name.rpartition(".")
    module, _, projection = rest.rpartition(".")
    if not index.isdigit() or projection not in PROJECTIONS:
        return None
    try:
        experts = model.get_submodule(module)
    except AttributeError:
        return None
    if not is_fused_experts(experts) or int(index) >= fused_experts_shape(experts)[0]:
        return None
    return module, projection, int(index)


class SliceHooks:
    """Forward hooks on the expert slices of one fused experts module: while registered, the module runs as an
    `UnfusedExperts` made from its weights at each call (a streamed block reads them just before), routed as
    transformers routes, with the hooks on its slices. `remove` gives the module its own forward back."""

    def __init__(self, experts: nn.Module, hooks: dict[tuple[str, int], Callable[..., None]]) -> None:
        self.experts, self.hooks = experts, hooks
        experts.forward = self.forward

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        unfused = UnfusedExperts(self.experts, every_token=False)
        for (projection, expert), hook in self.hooks.items():
            getattr(unfused, projection)[expert].register_forward_hook(hook)
        return unfused(hidden_states, top_k_index, top_k_weights)

    def remove(self) -> None:
        vars(self.experts).pop("forward", None)


def slice_hooks(model: nn.Module, hooks: dict[str, Callable[..., None]]) -> list[SliceHooks]:
    """Forward hooks (by expert slice name, `expert_slice`) on the slices of `model`'s fused experts modules,
    one `SliceHooks` per module; remove each when done."""
    grouped: dict[str, dict[tuple[str, int], Callable[..., None]]] = {}
    for name, hook in hooks.items():
        found = expert_slice(model, name)
        if found is None:
            raise ValueError(f"{name} is not an expert slice of a fused experts module")
        module, projection, expert = found
        grouped.setdefault(module, {})[projection, expert] = hook
    return [SliceHooks(model.get_submodule(module), module_hooks) for module, module_hooks in grouped.items()]


def starving_slices(
    unfused: dict[str, UnfusedExperts], names: dict[str, str], stats: dict[str, InputStats]
) -> dict[str, int]:
    """Relative name → tokens routed, of the expert slices in `names` whose expert received too few tokens."""
    starving = {}
    for relative, module in unfused.items():
        for projection in PROJECTIONS:
            for expert in range(module.num_experts):
                slice_name = f"{relative}.{projection}.{expert}"
                if slice_name in names and stats[slice_name].count < MIN_EXPERT_TOKENS:
                    starving[slice_name] = int(module.routed[expert])
    return starving


def fuse_experts(
    block: nn.Module,
    prefix: str,
    unfused: dict[str, UnfusedExperts],
    plan: "QuantizationPlan",
    starving: dict[str, int],
) -> None:
    """Put a `QuantizedExperts` in place of each `UnfusedExperts` of `block`: its slices quantized by the solver,
    or (the `starving` ones) by the data-free config, noted in the plan (`warn_data_free_experts` says so)."""
    for relative, module in unfused.items():
        name = f"{prefix}.{relative}"
        float_experts = module.fused[0]
        configs = {projection: plan.config_for(f"{name}.{projection}") for projection in PROJECTIONS}
        quantized = QuantizedExperts.empty_like(float_experts, plan.module_class, configs)
        for projection in PROJECTIONS:
            data_free = plan.data_free_for(f"{name}.{projection}")
            slices = []
            for expert, layer in enumerate(getattr(module, projection)):
                if isinstance(layer, QuantizedLinear):
                    slices.append(layer.stored_tensors())
                else:
                    slice_name = f"{name}.{projection}.{expert}"
                    slices.append(plan.module_class.quantize_checked(layer.weight, data_free, slice_name))
            quantized.load_stored(stack_slices(projection, slices))
        block.set_submodule(relative, quantized)
    if starving:
        plan.note_data_free_experts({f"{prefix}.{relative}": n for relative, n in starving.items()}, MIN_EXPERT_TOKENS)


def warn_data_free_experts(plan: "QuantizationPlan") -> None:
    """One warning line naming the expert slices the calibration left to the data-free solver, if any."""
    if not plan.data_free_experts:
        return
    first, why = next(iter(plan.data_free_experts.items()))
    warnings.warn(
        f"{len(plan.data_free_experts)} expert projection slice(s) received fewer than {MIN_EXPERT_TOKENS} "
        f"calibration tokens and were quantized by the data-free {plan.data_free.solver} solver ({first}: {why}); "
        f"calibrate on more text, or with expert_calibration='all'",
        DataFreeExpertsWarning,
        stacklevel=3,
    )
