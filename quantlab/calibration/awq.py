"""Activation-aware weight scaling (AWQ, Lin et al. 2023, arXiv 2306.00978), folded into the block.

Input channels that carry large activations matter most at the output. AWQ multiplies those
columns of the Linear layers by `s > 1` before quantizing (their relative rounding error
shrinks) and divides the previous operation's output by `s`, so the float block computes
exactly what it did. Per group of layers reading one input, `s = mean|x|^alpha` (normalised),
with `alpha` on a grid from 0 (no scaling) to 1, chosen by the squared error of the group's
outputs on calibration tokens when `W * s` is round-to-nearest quantized and divided by `s`.

Where `1/s` is folded, by the modules a block has (found by attribute names; other blocks are left
as they are, with one warning):

| block | previous operation | layers scaled |
| --- | --- | --- |
| Llama-like attention | input_layernorm | self_attn.q_proj, k_proj, v_proj |
| | self_attn.v_proj (when its outputs are o_proj's inputs: no GQA) | self_attn.o_proj |
| Phi-3 attention | input_layernorm | self_attn.qkv_proj |
| DeepSeek (latent) attention | input_layernorm | self_attn.q_a_proj (or q_proj), kv_a_proj_with_mqa |
| | self_attn.q_a_layernorm / kv_a_layernorm | self_attn.q_b_proj / kv_b_proj |
| dense MLP | the MLP's norm | mlp.gate_proj, up_proj (Phi-3: gate_up_proj) |
| | mlp.up_proj (Phi-3: gate_up_proj's up half) | mlp.down_proj |
| mixture of experts | the MLP's norm | every expert's gate_up_proj, the shared expert's gate/up |
| | each expert's gate_up_proj up half | that expert's down_proj |
| BERT-like | attention.self.value | attention.output.dense |

The MLP's norm is `pre_feedforward_layernorm` where a block has one (Gemma 2/3, whose
`post_attention_layernorm` normalizes the attention's output), else `post_attention_layernorm`.
A norm that multiplies by `1 + weight` (Gemma's) is folded as such. Modules that read the
scaled input but stay in float (a mixture's router, Qwen2-MoE's shared-expert gate) have their
columns multiplied by `s` too, exactly. A mixture's scales are measured on every token (the
router's input) and scored on each expert's own routed tokens (summed, so busy experts weigh
more); an expert's up -> down group needs `MIN_EXPERT_TOKENS` routed tokens, else it is left
unscaled. BERT's LayerNorms also feed its residual connections (a scaled output would change
them), and output.dense follows a GELU: only the value -> output projection is scaled there.
"""

import dataclasses
import warnings
from collections.abc import Callable

import torch
from torch import nn

from quantlab import distributed
from quantlab.calibration.blocks import BlockInputs, run_block
from quantlab.calibration.experts import MIN_EXPERT_TOKENS, UnfusedExperts

ALPHAS = 20
MAX_TOKENS = 2048  # calibration tokens the search scores on (spread over all batches)

_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class ScaleGroup:
    """Layers reading one input, and the operation whose output that input is."""

    previous: str  # a norm (weight, bias) or a Linear (output rows) whose output is the layers' input
    layers: tuple[str, ...]  # the Linear layers scaled and scored
    rows: tuple[int, int] | None = None  # the previous Linear's output rows that are the input (None: all)
    followers: tuple[str, ...] = ()  # other modules reading the input: scored if quantized, else only scaled
    source: str | None = None  # the module whose input the scales are measured on (None: the first layer)
    min_rows: int = 1  # fewer measured rows and the group is left unscaled (an expert that few tokens reach)

    @property
    def measured(self) -> str:
        return self.source or self.layers[0]


def scale_groups(block: nn.Module, names: dict[str, str]) -> list[ScaleGroup]:
    """The groups of `block` AWQ can scale, restricted to layers in `names` (those being quantized)."""
    modules = dict(block.named_modules())
    groups = _decoder_groups(modules) or _bert_groups(modules)
    if groups is None:
        kind = type(block).__name__
        if kind not in _warned:
            _warned.add(kind)
            warnings.warn(f"AWQ scaling does not apply to {kind} blocks: quantizing them without it", stacklevel=3)
        return []
    groups = [_scoring_quantized_followers(group, names) for group in groups]
    return [group for group in groups if all(layer in names for layer in group.layers) and _foldable(modules, group)]


def _scoring_quantized_followers(group: ScaleGroup, names: dict[str, str]) -> ScaleGroup:
    """`group` with the followers being quantized (Qwen2-MoE's shared-expert gate, unless skipped) among its layers."""
    quantized = tuple(follower for follower in group.followers if follower in names)
    followers = tuple(follower for follower in group.followers if follower not in names)
    return dataclasses.replace(group, layers=group.layers + quantized, followers=followers)


# -- the groups of each kind of block -----------------------------------------------------------------------


def _decoder_groups(modules: dict[str, nn.Module]) -> list[ScaleGroup] | None:
    """A pre-norm decoder block: its attention after `input_layernorm`, its MLP (dense or experts) after the MLP's
    norm; None unless both are recognized."""
    mlp_norm = "pre_feedforward_layernorm" if "pre_feedforward_layernorm" in modules else "post_attention_layernorm"
    if "input_layernorm" not in modules or mlp_norm not in modules:
        return None
    attention = _attention_groups(modules)
    mlp = _dense_mlp_groups(modules, mlp_norm) or _mixture_groups(modules, mlp_norm)
    return None if attention is None or mlp is None else [*attention, *mlp]


def _attention_groups(modules: dict[str, nn.Module]) -> list[ScaleGroup] | None:
    if _has(modules, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
        return [
            ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",)),
        ]
    if _has(modules, "self_attn.qkv_proj", "self_attn.o_proj"):  # Phi-3: q, k, v fused, in that order
        groups = [ScaleGroup("input_layernorm", ("self_attn.qkv_proj",))]
        queries, fused = modules["self_attn.o_proj"].in_features, modules["self_attn.qkv_proj"].out_features
        if fused == 3 * queries:  # no GQA: the v rows are o_proj's inputs
            groups.append(ScaleGroup("self_attn.qkv_proj", ("self_attn.o_proj",), rows=(2 * queries, fused)))
        return groups
    if _has(modules, "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj"):
        query = "self_attn.q_a_proj" if "self_attn.q_a_proj" in modules else "self_attn.q_proj"
        groups = [
            ScaleGroup("input_layernorm", (query, "self_attn.kv_a_proj_with_mqa")),
            ScaleGroup("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",)),
        ]
        if _has(modules, "self_attn.q_a_layernorm", "self_attn.q_b_proj"):
            groups.append(ScaleGroup("self_attn.q_a_layernorm", ("self_attn.q_b_proj",)))
        return groups
    return None


def _dense_mlp_groups(modules: dict[str, nn.Module], norm: str) -> list[ScaleGroup] | None:
    if _has(modules, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        return [ScaleGroup(norm, ("mlp.gate_proj", "mlp.up_proj")), ScaleGroup("mlp.up_proj", ("mlp.down_proj",))]
    if _has(modules, "mlp.gate_up_proj", "mlp.down_proj"):  # Phi-3: gate then up, fused
        fused = modules["mlp.gate_up_proj"].out_features
        return [
            ScaleGroup(norm, ("mlp.gate_up_proj",)),
            ScaleGroup("mlp.gate_up_proj", ("mlp.down_proj",), rows=(fused // 2, fused)),
        ]
    return None


def _mixture_groups(modules: dict[str, nn.Module], norm: str) -> list[ScaleGroup] | None:
    """A mixture of experts (its fused experts unfused for calibration) behind its router `mlp.gate`, with or
    without a shared expert (`mlp.shared_expert` or `mlp.shared_experts`, and Qwen2-MoE's `shared_expert_gate`)."""
    experts = modules.get("mlp.experts")
    if not isinstance(experts, UnfusedExperts) or "mlp.gate" not in modules:
        return None
    inputs = [f"mlp.experts.gate_up_proj.{expert}" for expert in range(experts.num_experts)]
    followers = ["mlp.gate"]
    groups = []
    for shared in ("mlp.shared_expert", "mlp.shared_experts"):
        if _has(modules, f"{shared}.gate_proj", f"{shared}.up_proj", f"{shared}.down_proj"):
            inputs += [f"{shared}.gate_proj", f"{shared}.up_proj"]
            groups.append(ScaleGroup(f"{shared}.up_proj", (f"{shared}.down_proj",)))
    if "mlp.shared_expert_gate" in modules:
        followers.append("mlp.shared_expert_gate")
    for expert in range(experts.num_experts):
        fused = experts.gate_up_proj[expert].out_features
        groups.append(
            ScaleGroup(
                f"mlp.experts.gate_up_proj.{expert}",
                (f"mlp.experts.down_proj.{expert}",),
                rows=(fused // 2, fused),
                min_rows=MIN_EXPERT_TOKENS,
            )
        )
    return [ScaleGroup(norm, tuple(inputs), followers=tuple(followers), source="mlp.gate"), *groups]


def _bert_groups(modules: dict[str, nn.Module]) -> list[ScaleGroup] | None:
    if _has(modules, "attention.self.value", "attention.output.dense"):
        return [ScaleGroup("attention.self.value", ("attention.output.dense",))]
    return None


def _has(modules: dict[str, nn.Module], *names: str) -> bool:
    return all(name in modules for name in names)


def _foldable(modules: dict[str, nn.Module], group: ScaleGroup) -> bool:
    previous, first = modules[group.previous], modules[group.layers[0]]
    if isinstance(previous, nn.Linear):
        start, stop = group.rows or (0, previous.out_features)
        return stop - start == first.in_features
    weight = getattr(previous, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.numel() == first.in_features


# -- search and fold ----------------------------------------------------------------------------------------


@torch.no_grad()
def scale_block(
    block: nn.Module,
    batches: list[BlockInputs],
    names: dict[str, str],
    fake_quantize: Callable[[torch.Tensor, str], torch.Tensor],
) -> dict[str, float]:
    """Search and fold the scales of every group of `block`; returns each group's chosen alpha.
    `fake_quantize(weight, name)`: the weight as the layer `name` (full name) would store it, in float."""
    groups = scale_groups(block, names)
    if not groups:
        return {}
    measured = {group.measured for group in groups} | {layer for group in groups for layer in group.layers}
    inputs = _captured_inputs(block, sorted(measured), batches)
    chosen = {}
    for group in groups:
        scales, alpha = _search(block, group, inputs, fake_quantize, names)
        if alpha > 0:
            _fold(block, group, scales)
        chosen[group.previous] = alpha
    return chosen


def _captured_inputs(block: nn.Module, modules: list[str], batches: list[BlockInputs]) -> dict[str, list[torch.Tensor]]:
    """Up to MAX_TOKENS input rows of each named module, spread evenly over the batches of every process; one
    tensor per batch in which the module ran (an expert runs only on the batches that route tokens to it).
    Modules reading the same tensor in a batch share its captured rows."""
    per_batch = max(1, MAX_TOKENS // distributed.total(len(batches)))
    captured: dict[str, list[torch.Tensor]] = {module: [] for module in modules}
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id → (the input, kept so its id is not reused; rows)

    def hook_for(module_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0]
            if id(x) not in seen:
                rows = x.reshape(-1, x.shape[-1])
                step = max(1, rows.shape[0] // per_batch)
                seen[id(x)] = (x, rows[::step][:per_batch].float())
            captured[module_name].append(seen[id(x)][1])

        return hook

    handles = [block.get_submodule(module).register_forward_hook(hook_for(module)) for module in modules]
    try:
        for batch in batches:
            run_block(block, batch)
            seen.clear()
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _search(
    block: nn.Module,
    group: ScaleGroup,
    inputs: dict[str, list[torch.Tensor]],
    fake_quantize: Callable[[torch.Tensor, str], torch.Tensor],
    names: dict[str, str],
) -> tuple[torch.Tensor, float]:
    """The scales with the least output error of the group's layers, and their alpha (0: none).

    The channel magnitudes (on the measured module's inputs) and each candidate's squared error (on each layer's
    own inputs) are summed per batch of input rows in float64 and added in batch order over every process's
    batches, so every process (and one process alone) picks the same alpha. Each layer's error is divided by
    the measured rows, so a layer that saw a share of the tokens (an expert) weighs by that share."""
    weights = [block.get_submodule(layer).weight.detach().float() for layer in group.layers]
    chunks = inputs[group.measured]
    in_features = weights[0].shape[1]
    counted = [torch.cat([x.abs().sum(dim=0), torch.tensor([x.shape[0]])]).double() for x in chunks]
    sums = distributed.sum_rows_in_order(torch.stack(counted) if counted else torch.zeros(0, in_features + 1).double())
    rows = float(sums[-1])
    if rows < group.min_rows:
        return torch.ones(in_features), 0.0
    magnitude = (sums[:-1] / rows).float().clamp(min=1e-8)
    candidates = [_candidate(magnitude, step) for step in range(ALPHAS)]
    totals = []
    for layer, weight in zip(group.layers, weights, strict=True):
        errors = torch.zeros(len(inputs[layer]), ALPHAS, dtype=torch.float64)
        for step, scales in enumerate(candidates):
            quantized = fake_quantize(weight * scales, names[layer]) / scales
            for chunk, x in enumerate(inputs[layer]):
                errors[chunk, step] = (x @ (quantized - weight).T).double().square().sum()
        totals.append(distributed.sum_rows_in_order(errors))
    outputs = torch.tensor([weight.shape[0] for weight in weights], dtype=torch.float64)
    error = (torch.stack(totals, dim=1) / (rows * outputs)).sum(dim=1).tolist()
    best = min(range(ALPHAS), key=lambda step: (error[step], step))
    return candidates[best], best / ALPHAS


def _candidate(magnitude: torch.Tensor, step: int) -> torch.Tensor:
    """The scales `magnitude ** (step / ALPHAS)`, normalised so their largest and smallest multiply to 1."""
    scales = magnitude.pow(step / ALPHAS)
    return (scales / (scales.max() * scales.min()).sqrt()).clamp(min=1e-4)


def _fold(block: nn.Module, group: ScaleGroup, scales: torch.Tensor) -> None:
    """Divide the previous operation's output by `scales` and multiply the columns of the layers (and of the float
    modules reading the same input) by them."""
    previous = block.get_submodule(group.previous)
    if isinstance(previous, nn.Linear):
        start, stop = group.rows or (0, previous.out_features)
        previous.weight[start:stop].div_(scales.unsqueeze(1).to(previous.weight.dtype))
        if previous.bias is not None:
            previous.bias[start:stop].div_(scales.to(previous.bias.dtype))
    else:
        offset = _norm_offset(previous)  # Gemma's norms multiply by 1 + weight
        previous.weight.add_(offset).div_(scales.to(previous.weight.dtype)).sub_(offset)
        if getattr(previous, "bias", None) is not None:
            previous.bias.div_(scales.to(previous.bias.dtype))
    for name in (*group.layers, *group.followers):
        module = block.get_submodule(name)
        module.weight.mul_(scales.to(module.weight.dtype))


def _norm_offset(norm: nn.Module) -> float:
    """1.0 for a norm whose output is `(1 + weight) * normalized` (Gemma's RMSNorm), 0.0 for `weight * normalized`:
    probed by running it with its weight (and bias) set to zero."""
    saved = {name: tensor.detach().clone() for name, tensor in norm.named_parameters(recurse=False)}
    probe = torch.ones(1, norm.weight.numel(), dtype=norm.weight.dtype)
    probe[0, 0] = 2.0  # not constant: a LayerNorm of a constant row is zero whatever its weight
    try:
        for tensor in norm.parameters(recurse=False):
            tensor.zero_()
        output = norm(probe)
    finally:
        for name, tensor in norm.named_parameters(recurse=False):
            tensor.copy_(saved[name])
    return 0.0 if bool((output == 0).all()) else 1.0
