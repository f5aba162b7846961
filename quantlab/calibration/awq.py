"""Activation-aware weight scaling (AWQ, Lin et al. 2023, arXiv 2306.00978), folded into the block.

Input channels that carry large activations matter most at the output. AWQ multiplies those
columns of the Linear layers by `s > 1` before quantizing (their relative rounding error
shrinks) and divides the previous operation's output by `s`, so the float block computes
exactly what it did. Per group of layers reading one input, `s = mean|x|^alpha` (normalised),
with `alpha` on a grid from 0 (no scaling) to 1, chosen by the squared error of the group's
outputs on calibration tokens when `W * s` is round-to-nearest quantized and divided by `s`.

Where `1/s` is folded, by architecture (found by attribute names; other blocks are left as
they are, with one warning):

| family | previous operation | layers scaled |
| --- | --- | --- |
| Llama-like | input_layernorm | self_attn.q_proj, k_proj, v_proj |
| | self_attn.v_proj (when its outputs are o_proj's inputs: no GQA) | self_attn.o_proj |
| | post_attention_layernorm | mlp.gate_proj, up_proj |
| | mlp.up_proj | mlp.down_proj |
| BERT-like | attention.self.value | attention.output.dense |

BERT's LayerNorms also feed its residual connections (a scaled output would change them), and
output.dense follows a GELU: only the value -> output projection is scaled there.
"""

import dataclasses
import warnings
from collections.abc import Callable

import torch
from torch import nn

from quantlab import distributed
from quantlab.calibration.blocks import BlockInputs, run_block

ALPHAS = 20
MAX_TOKENS = 2048  # calibration tokens the search scores on (spread over all batches)

_FAMILIES = {
    "llama": (
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.v_proj", ("self_attn.o_proj",)),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.up_proj", ("mlp.down_proj",)),
    ),
    "bert": (("attention.self.value", ("attention.output.dense",)),),
}
_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class ScaleGroup:
    previous: str  # a norm (weight, bias) or a Linear (output rows) whose output is the layers' input
    layers: tuple[str, ...]


def scale_groups(block: nn.Module, names: dict[str, str]) -> list[ScaleGroup]:
    """The groups of `block` AWQ can scale, restricted to layers in `names` (those being quantized)."""
    modules = dict(block.named_modules())
    for groups in _FAMILIES.values():
        if all(previous in modules and all(layer in modules for layer in layers) for previous, layers in groups):
            return [
                ScaleGroup(previous, layers)
                for previous, layers in groups
                if all(layer in names for layer in layers) and _foldable(modules[previous], modules[layers[0]])
            ]
    kind = type(block).__name__
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(f"AWQ scaling does not apply to {kind} blocks: quantizing them without it", stacklevel=3)
    return []


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
    inputs = _group_inputs(block, [group.layers[0] for group in groups], batches)
    chosen = {}
    for group in groups:
        scales, alpha = _search(block, group, inputs[group.layers[0]], fake_quantize, names)
        if alpha > 0:
            _fold(block, group, scales)
        chosen[group.previous] = alpha
    return chosen


def _foldable(previous: nn.Module, first: nn.Module) -> bool:
    if isinstance(previous, nn.Linear):
        return previous.out_features == first.in_features
    return getattr(previous, "weight", None) is not None and previous.weight.numel() == first.in_features


def _group_inputs(block: nn.Module, layers: list[str], batches: list[BlockInputs]) -> dict[str, list[torch.Tensor]]:
    """Up to MAX_TOKENS input rows of each named layer, spread evenly over the batches of every
    process; one tensor per batch."""
    per_batch = max(1, MAX_TOKENS // distributed.total(len(batches)))
    captured: dict[str, list[torch.Tensor]] = {layer: [] for layer in layers}

    def hook_for(layer: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            rows = args[0].reshape(-1, args[0].shape[-1])
            step = max(1, rows.shape[0] // per_batch)
            captured[layer].append(rows[::step][:per_batch].float())

        return hook

    handles = [block.get_submodule(layer).register_forward_hook(hook_for(layer)) for layer in layers]
    try:
        for batch in batches:
            run_block(block, batch)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _search(
    block: nn.Module,
    group: ScaleGroup,
    chunks: list[torch.Tensor],
    fake_quantize: Callable[[torch.Tensor, str], torch.Tensor],
    names: dict[str, str],
) -> tuple[torch.Tensor, float]:
    """The scales with the least output error of the group's layers, and their alpha (0: none).

    The channel magnitudes and each candidate's squared error are summed per batch of input rows
    (`chunks`) in float64 and added in batch order over every process's batches, so every process
    (and one process alone) picks the same alpha."""
    weights = [block.get_submodule(layer).weight.detach().float() for layer in group.layers]
    sums = distributed.sum_rows_in_order(
        torch.stack([torch.cat([x.abs().sum(dim=0), torch.tensor([x.shape[0]])]).double() for x in chunks])
    )
    rows = float(sums[-1])
    magnitude = (sums[:-1] / rows).float().clamp(min=1e-8)
    candidates = []
    errors = torch.zeros(len(chunks), ALPHAS, len(weights), dtype=torch.float64)
    for step in range(ALPHAS):
        scales = magnitude.pow(step / ALPHAS)
        scales = (scales / (scales.max() * scales.min()).sqrt()).clamp(min=1e-4)
        candidates.append(scales)
        for index, (layer, weight) in enumerate(zip(group.layers, weights, strict=True)):
            quantized = fake_quantize(weight * scales, names[layer]) / scales
            for chunk, x in enumerate(chunks):
                errors[chunk, step, index] = (x @ (quantized - weight).T).double().square().sum()
    totals = distributed.sum_rows_in_order(errors)
    outputs = torch.tensor([weight.shape[0] for weight in weights], dtype=torch.float64)
    error = (totals / (rows * outputs)).sum(dim=1).tolist()
    best = min(range(ALPHAS), key=lambda step: (error[step], step))
    return candidates[best], best / ALPHAS


def _fold(block: nn.Module, group: ScaleGroup, scales: torch.Tensor) -> None:
    """Divide the previous operation's output by `scales` and multiply the layers' columns by them."""
    previous = block.get_submodule(group.previous)
    if isinstance(previous, nn.Linear):
        previous.weight.div_(scales.unsqueeze(1).to(previous.weight.dtype))
    else:
        previous.weight.div_(scales.to(previous.weight.dtype))
    if getattr(previous, "bias", None) is not None:
        previous.bias.div_(scales.to(previous.bias.dtype))
    for layer in group.layers:
        linear = block.get_submodule(layer)
        linear.weight.mul_(scales.to(linear.weight.dtype))
