"""Mixed precision: each layer's width, group size and zero points, chosen to minimise predicted loss on a budget.

A measurement pass runs the float model block by block over the calibration windows and, for
every quantizable layer and every candidate of the method (`config.allocation_candidates()`:
widths 2-8 at group sizes 32-128, with and without zero points, for custom bits), predicts the
loss the layer would add as `F_l / 2 * sum_j E[x_j^2] ||W_:,j - Q_:,j||^2`: its output error
(round to nearest on the candidate's grid, columns weighted by the calibration inputs, in the
spirit of EXL2's measurement pass) times the layer's empirical Fisher `F_l`, the mean squared
gradient of the loss at its output (`sensitivity.output_fisher`; an encoder with no loss uses the
error relative to the layer's output instead). It counts each candidate's stored bytes (codes,
scales, zero points: `StorageLayout.stored_bytes`). The assignment minimising the summed loss with
total bytes at most `target_bits * weights / 8` is a multiple-choice knapsack, solved exactly by
dynamic programming over the budget cut into `BUDGET_STEPS` units (each candidate's bytes rounded
up to whole units, so the budget always holds).

A fused experts projection (`<block>.mlp.experts.gate_up_proj`, `.down_proj`) is one unit: its
candidates are option sets that apply to all its expert slices (one layout per projection), its
bytes are every slice's, and its predicted loss is the sum over its slices of each slice's, with
the slice's own input statistics (gathered as the calibration gathers them: on the tokens routed
to its expert, or on every token under `expert_calibration="all"`) and its own Fisher, from the
gradient at that expert's output on its routed tokens (so scaled by the share of tokens it gets).
The routers stay float and, like every float weight, count neither as weights nor as bytes."""

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from quantlab import distributed
from quantlab.calibration.blocks import BlockInputs, BlockWeights, find_blocks, first_block_inputs
from quantlab.calibration.experts import restore_experts, unfuse_experts
from quantlab.calibration.sensitivity import output_fisher
from quantlab.calibration.sequential import BATCH_SIZE, collect_input_stats, selected_linears
from quantlab.config import QuantlabConfig
from quantlab.errors import ConfigError
from quantlab.formats import grouping
from quantlab.formats.layout import GroupParams, StorageLayout
from quantlab.nn import QuantizedLinear
from quantlab.nn.kinds import as_linear
from quantlab.nn.rotation import rotate, rotate_square, rotation_block
from quantlab.solvers import InputStats
from quantlab.solvers.mse import column_importance

if TYPE_CHECKING:
    from quantlab.plan import QuantizationPlan

BUDGET_STEPS = 20_000


@dataclasses.dataclass(frozen=True)
class Candidate:
    options: tuple[tuple[str, Any], ...]
    stored_bytes: int
    loss: float


@torch.no_grad()
def allocate_bits(
    model: nn.Module,
    plan: "QuantizationPlan",
    windows: torch.Tensor,
    progress: bool = True,
    block_weights: BlockWeights | None = None,
) -> dict[str, dict[str, Any]]:
    """Per-layer options meeting `config.target_bits` (only layers whose choice differs from the config), by
    Linear layer and by experts projection.

    Layers the user named in `config.layer_options` keep those options: their bytes count against the
    budget, and the other layers are chosen around them.
    `block_weights`: where the blocks' weights are (default: in the model; streamed: read block by block)."""
    config = plan.config
    measured, weights = measure_layers(model, plan, windows, progress, block_weights)
    budget = int(config.target_bits * weights / 8)
    chosen = choose(measured, budget, config.target_bits, weights)
    own = {name: getattr(config, name) for name in config.allocation_candidates()[0]}
    return {layer: dict(pick.options) for layer, pick in chosen.items() if dict(pick.options) != own}


def layer_candidates(config: QuantlabConfig, layer: str) -> list[tuple[dict[str, Any], QuantlabConfig]]:
    """The option sets mixed precision may give `layer` (a Linear layer or an experts projection), each with the
    config it quantizes under: the method's candidates, or only the user's own `layer_options` for a layer they
    named."""
    pinned = (config.layer_options or {}).get(layer)
    if pinned:
        return [(dict(pinned), config.for_one_layer(**pinned))]
    return [(options, config.for_one_layer(**options)) for options in config.allocation_candidates()]


def check_budget_reachable(model: nn.Module, plan: "QuantizationPlan") -> None:
    """Refuse a `target_bits` no assignment of the candidates can meet, from the layers' shapes alone:
    before any calibration text is made or any weight is read (the model may sit on the meta device)."""
    config, module_class = plan.config, plan.module_class
    prefix, blocks = find_blocks(model)
    smallest = largest = weights = 0
    for index, block in enumerate(blocks):
        shapes = {
            full_name: (*as_linear(block.get_submodule(relative)).weight.shape, 1)
            for relative, full_name in selected_linears(block, f"{prefix}.{index}", plan.selects).items()
        }
        shapes.update(_experts_shapes(plan, f"{prefix}.{index}"))
        for full_name, (out_features, in_features, count) in shapes.items():
            candidates = [c for _, c in layer_candidates(config, full_name)]
            sizes = [module_class.layout_for(in_features, out_features, c).stored_bytes() * count for c in candidates]
            smallest, largest, weights = (
                smallest + min(sizes),
                largest + max(sizes),
                weights + in_features * out_features * count,
            )
    if weights:
        _refuse_unreachable(config.target_bits, int(config.target_bits * weights / 8), smallest, largest, weights)


def _experts_shapes(plan: "QuantizationPlan", block: str) -> dict[str, tuple[int, int, int]]:
    """Experts projection → (out, in, experts) of the planned fused experts projections inside `block`."""
    return {
        name: (layer.out_features, layer.in_features, layer.experts)
        for name, layer in plan.layers.items()
        if layer.experts and name.startswith(f"{block}.")
    }


def _refuse_unreachable(target_bits: float, budget: int, smallest: int, largest: int, weights: int) -> None:
    if budget < smallest or budget > largest:
        low, high = 8 * smallest / weights, 8 * largest / weights
        raise ConfigError(
            f"target_bits={target_bits:g} is outside what the candidate widths can store on this model "
            f"({low:.3f} to {high:.3f} bits per weight); choose a target in that range"
        )


def measure_layers(
    model: nn.Module,
    plan: "QuantizationPlan",
    windows: torch.Tensor,
    progress: bool = True,
    block_weights: BlockWeights | None = None,
) -> tuple[dict[str, list[Candidate]], int]:
    """Each selected layer's (and experts projection's) candidates with predicted loss and bytes, and the number
    of weights."""
    block_weights = block_weights or BlockWeights()
    prefix, blocks = find_blocks(model)
    layer_names = [
        name
        for i, block in enumerate(blocks)
        for name in selected_linears(block, f"{prefix}.{i}", plan.selects).values()
    ] + _expert_slice_names(plan)
    with block_weights.whole_model():
        fisher = output_fisher(model, windows, layer_names)
    batches = first_block_inputs(model, blocks[0], distributed.share_of_windows(windows, BATCH_SIZE), BATCH_SIZE)
    measured: dict[str, list[Candidate]] = {}
    options: dict[str, list[tuple[dict[str, Any], QuantlabConfig]]] = {}  # by unit: an experts projection's, once
    weights = 0
    for index, block in enumerate(
        tqdm(blocks, desc="measuring layers", disable=not (progress and distributed.is_main()))
    ):
        block_weights.load(index, block)
        unfused = unfuse_experts(block, f"{prefix}.{index}", plan)  # each expert slice an `nn.Linear`
        names = selected_linears(block, f"{prefix}.{index}", plan.selects)
        outputs: list[torch.Tensor] = []
        stats = collect_input_stats(block, names, batches, outputs)
        batches = [BlockInputs(output, batch.kwargs) for output, batch in zip(outputs, batches, strict=True)]
        for relative, full_name in names.items():
            weight = as_linear(block.get_submodule(relative)).weight.detach().float()
            weights += weight.numel()
            unit = _experts_projection(plan, full_name) or full_name
            if unit not in options:
                options[unit] = layer_candidates(plan.config, unit)
            candidates = _measure_layer(plan, full_name, unit, options[unit], weight, stats[relative], fisher)
            measured[unit] = _summed(measured[unit], candidates) if unit in measured else candidates
        restore_experts(block, unfused)
        block_weights.release(index, block)
    return measured, weights


def _expert_slice_names(plan: "QuantizationPlan") -> list[str]:
    """The full name of every expert slice (`{projection}.{expert}`) of the planned experts projections."""
    return [
        f"{name}.{expert}" for name, layer in plan.layers.items() if layer.experts for expert in range(layer.experts)
    ]


def _experts_projection(plan: "QuantizationPlan", name: str) -> str | None:
    """The planned experts projection the expert slice `name` belongs to, or None for a Linear layer."""
    parent = name.rpartition(".")[0]
    layer = plan.layers.get(parent)
    return parent if layer is not None and layer.experts else None


def _measure_layer(
    plan: "QuantizationPlan",
    name: str,
    unit: str,
    options: list[tuple[dict[str, Any], QuantlabConfig]],
    weight: torch.Tensor,
    stats: InputStats,
    fisher: dict[str, float] | None,
) -> list[Candidate]:
    """The candidates `options` (`layer_candidates`) of the Linear layer (or expert slice) `name` of the allocation
    unit `unit`, with their predicted loss and bytes; an expert slice is never rotated (the experts' inputs are
    not)."""
    config = plan.config
    if unit == name and config.rotates_input_of(name):  # its codes store `W R`, for inputs `x R`
        rotation = rotation_block(weight.shape[1], config.rotation_blocks)
        weight = rotate(weight, rotation)
        stats = stats.transformed(lambda hessian, r=rotation: rotate_square(hessian, r))
    importance = stats.channel_weights() * _output_cost(name, weight, stats, fisher)
    return [_candidate(plan.module_class, c, o, weight, importance) for o, c in options]


def _output_cost(name: str, weight: torch.Tensor, stats: InputStats, fisher: dict[str, float] | None) -> float:
    """What a unit of squared output error of the layer `name` costs: the loss it adds, to second order, or with
    no loss to differentiate (encoders) its share of the layer's output `1 / ||W x||^2`."""
    if fisher is None:
        return 1.0 / (float((weight @ stats.hessian * weight).sum()) or 1.0)
    return fisher[name] / 2


def _summed(total: list[Candidate], more: list[Candidate]) -> list[Candidate]:
    """Each candidate of an experts projection with one more slice's bytes and predicted loss added."""
    return [
        Candidate(a.options, a.stored_bytes + b.stored_bytes, a.loss + b.loss) for a, b in zip(total, more, strict=True)
    ]


def choose(measured: dict[str, list[Candidate]], budget: int, target_bits: float, weights: int) -> dict[str, Candidate]:
    """The assignment with the least summed loss whose bytes fit `budget` (dynamic programming)."""
    smallest = sum(min(c.stored_bytes for c in options) for options in measured.values())
    largest = sum(max(c.stored_bytes for c in options) for options in measured.values())
    _refuse_unreachable(target_bits, budget, smallest, largest, weights)
    unit = max(1, -(-budget // BUDGET_STEPS))
    units = budget // unit
    best = torch.zeros(units + 1, dtype=torch.float64)  # least loss of the layers so far within b units
    picks = []
    for options in measured.values():
        cost = [-(-c.stored_bytes // unit) for c in options]
        candidates = torch.full((len(options), units + 1), float("inf"), dtype=torch.float64)
        for index, (candidate, size) in enumerate(zip(options, cost, strict=True)):
            if size <= units:
                candidates[index, size:] = best[: units + 1 - size] + candidate.loss
        best, pick = candidates.min(dim=0)
        picks.append(pick)
    if not torch.isfinite(best[units]):
        raise ConfigError(
            f"target_bits={target_bits:g} leaves too little room once bytes are rounded; raise it a little"
        )
    chosen: dict[str, Candidate] = {}
    remaining = units
    for (layer, options), pick in zip(reversed(measured.items()), reversed(picks), strict=True):
        candidate = options[int(pick[remaining])]
        chosen[layer] = candidate
        remaining -= -(-candidate.stored_bytes // unit)
    return chosen


def _candidate(
    module_class: type[QuantizedLinear],
    config: QuantlabConfig,
    options: dict[str, Any],
    weight: torch.Tensor,
    importance: torch.Tensor,
) -> Candidate:
    layout = module_class.layout_for(weight.shape[1], weight.shape[0], config)
    grouped = grouping.group(weight, layout.group_size)
    column_weights = column_importance(layout, importance)  # zero on the padding of a last short group
    group_loss = _group_loss(layout, grouped, layout.fit(grouped), column_weights)
    if layout.signed_grids:  # the solvers pick each group's orientation: so does the prediction
        signed = _group_loss(layout, grouped, layout.fit(grouped, signed=True), column_weights)
        group_loss = torch.minimum(group_loss, signed)
    return Candidate(tuple(options.items()), layout.stored_bytes(), float(group_loss.sum()))


def _group_loss(
    layout: StorageLayout, grouped: torch.Tensor, params: GroupParams, column_weights: torch.Tensor
) -> torch.Tensor:
    """Per group `[out, groups]`: the squared rounding error of each weight times its column's weight."""
    codes = layout.quantize_grouped(grouped, params)
    zero = None if params.zero is None else params.zero.unsqueeze(-1)
    error = layout.decode(codes, params.scale.unsqueeze(-1), zero) - grouped
    return (error.square() * column_weights).sum(dim=-1)
