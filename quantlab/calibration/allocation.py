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
up to whole units, so the budget always holds)."""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from quantlab import distributed
from quantlab.calibration.blocks import BlockInputs, BlockWeights, find_blocks, first_block_inputs
from quantlab.calibration.sensitivity import output_fisher
from quantlab.calibration.sequential import BATCH_SIZE, collect_input_stats, selected_linears
from quantlab.config import QuantlabConfig
from quantlab.errors import ConfigError
from quantlab.formats import grouping
from quantlab.formats.layout import GroupParams, StorageLayout
from quantlab.nn import QuantizedLinear
from quantlab.nn.rotation import rotate, rotate_square, rotation_block
from quantlab.solvers.mse import column_importance

BUDGET_STEPS = 20_000


@dataclasses.dataclass(frozen=True)
class Candidate:
    options: tuple[tuple[str, Any], ...]
    stored_bytes: int
    loss: float


@torch.no_grad()
def allocate_bits(
    model: nn.Module,
    config: QuantlabConfig,
    module_class: type[QuantizedLinear],
    windows: torch.Tensor,
    selected: Callable[[str], bool],
    progress: bool = True,
    block_weights: BlockWeights | None = None,
) -> dict[str, dict[str, Any]]:
    """Per-layer options meeting `config.target_bits` (only layers whose choice differs from the config).

    Layers the user named in `config.layer_options` keep those options: their bytes count against the
    budget, and the other layers are chosen around them.
    `block_weights`: where the blocks' weights are (default: in the model; streamed: read block by block)."""
    measured, weights = measure_layers(model, config, module_class, windows, selected, progress, block_weights)
    budget = int(config.target_bits * weights / 8)
    chosen = choose(measured, budget, config.target_bits, weights)
    own = {name: getattr(config, name) for name in config.allocation_candidates()[0]}
    return {layer: dict(pick.options) for layer, pick in chosen.items() if dict(pick.options) != own}


def layer_candidates(config: QuantlabConfig, layer: str) -> list[tuple[dict[str, Any], QuantlabConfig]]:
    """The option sets mixed precision may give `layer`, each with the config it quantizes under: the method's
    candidates, or only the user's own `layer_options` for a layer they named."""
    pinned = (config.layer_options or {}).get(layer)
    if pinned:
        return [(dict(pinned), config.for_one_layer(**pinned))]
    return [(options, config.for_one_layer(**options)) for options in config.allocation_candidates()]


def check_budget_reachable(
    model: nn.Module, config: QuantlabConfig, module_class: type[QuantizedLinear], selected: Callable[[str], bool]
) -> None:
    """Refuse a `target_bits` no assignment of the candidates can meet, from the layers' shapes alone:
    before any calibration text is made or any weight is read (the model may sit on the meta device)."""
    prefix, blocks = find_blocks(model)
    smallest = largest = weights = 0
    for index, block in enumerate(blocks):
        for relative, full_name in selected_linears(block, f"{prefix}.{index}", selected).items():
            out_features, in_features = block.get_submodule(relative).weight.shape
            candidates = [c for _, c in layer_candidates(config, full_name)]
            sizes = [module_class.layout_for(in_features, out_features, c).stored_bytes() for c in candidates]
            smallest, largest, weights = (
                smallest + min(sizes),
                largest + max(sizes),
                weights + in_features * out_features,
            )
    if weights:
        _refuse_unreachable(config.target_bits, int(config.target_bits * weights / 8), smallest, largest, weights)


def _refuse_unreachable(target_bits: float, budget: int, smallest: int, largest: int, weights: int) -> None:
    if budget < smallest or budget > largest:
        low, high = 8 * smallest / weights, 8 * largest / weights
        raise ConfigError(
            f"target_bits={target_bits:g} is outside what the candidate widths can store on this model "
            f"({low:.3f} to {high:.3f} bits per weight); choose a target in that range"
        )


def measure_layers(
    model: nn.Module,
    config: QuantlabConfig,
    module_class: type[QuantizedLinear],
    windows: torch.Tensor,
    selected: Callable[[str], bool],
    progress: bool = True,
    block_weights: BlockWeights | None = None,
) -> tuple[dict[str, list[Candidate]], int]:
    """Each selected layer's candidates with predicted loss and bytes, and the number of weights."""
    block_weights = block_weights or BlockWeights()
    prefix, blocks = find_blocks(model)
    layer_names = [
        name for i, block in enumerate(blocks) for name in selected_linears(block, f"{prefix}.{i}", selected).values()
    ]
    with block_weights.whole_model():
        fisher = output_fisher(model, windows, layer_names)
    batches = first_block_inputs(model, blocks[0], distributed.share_of_windows(windows, BATCH_SIZE), BATCH_SIZE)
    measured: dict[str, list[Candidate]] = {}
    weights = 0
    for index, block in enumerate(
        tqdm(blocks, desc="measuring layers", disable=not (progress and distributed.is_main()))
    ):
        block_weights.load(index, block)
        names = selected_linears(block, f"{prefix}.{index}", selected)
        outputs: list[torch.Tensor] = []
        stats = collect_input_stats(block, names, batches, outputs)
        batches = [BlockInputs(output, batch.kwargs) for output, batch in zip(outputs, batches, strict=True)]
        for relative, full_name in names.items():
            weight = block.get_submodule(relative).weight.detach().float()
            weights += weight.numel()
            layer_stats = stats[relative]
            if config.rotates_input_of(full_name):  # its codes store `W R`, for inputs `x R`
                rotation = rotation_block(weight.shape[1], config.rotation_blocks)
                weight = rotate(weight, rotation)
                layer_stats = layer_stats.transformed(lambda hessian, r=rotation: rotate_square(hessian, r))
            if fisher is None:  # no loss to differentiate (encoders): the error relative to the layer's output
                cost = 1.0 / (float((weight @ layer_stats.hessian * weight).sum()) or 1.0)  # 1 / ||W x||^2
            else:  # the loss the layer's output error adds, to second order
                cost = fisher[full_name] / 2
            importance = layer_stats.channel_weights() * cost
            candidates = layer_candidates(config, full_name)
            measured[full_name] = [_candidate(module_class, c, o, weight, importance) for o, c in candidates]
        block_weights.release(index, block)
    return measured, weights


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
