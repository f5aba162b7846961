"""Block-by-block calibrated quantization (the GPTQ schedule).

Only one block's inputs are held at a time: the inputs of block i+1 are the outputs of block
i computed with block i already quantized, so each block's solver sees, and corrects for,
the error of every block before it. Per block:

1. optional activation-aware scaling (AWQ) of its Linear layers, folded into the block;
2. one pass over the calibration batches that accumulates each Linear layer's input
   statistics (layers reading the same input, q/k/v or gate/up, share one);
3. each selected Linear layer is solved and replaced by the method's quantized layer;
   a block-wise solver (`reconstruct`) then trains the block's layers jointly on its outputs
   (`quantlab.calibration.block_training`);
4. a second pass computes the block's outputs with the quantized weights.

Peak memory is the float model (one block of it when streamed: `quantlab.streaming`), plus the
calibration activations (two copies of `samples x seq_len x hidden` floats), plus the statistics
of one block (`in x in` floats per distinct input). A block's statistics are complete when
`collect_input_stats` returns, before any of its layers is solved.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from quantlab import distributed
from quantlab.calibration.awq import scale_block
from quantlab.calibration.block_training import BlockReconstruction
from quantlab.calibration.blocks import (
    Activations,
    BlockInputs,
    BlockWeights,
    find_blocks,
    first_block_inputs,
    run_block,
    run_block_on_batches,
)
from quantlab.calibration.experts import fuse_experts, starving_slices, unfuse_experts, warn_data_free_experts
from quantlab.calibration.solving import quantize_layers
from quantlab.config import QuantlabConfig
from quantlab.errors import QuantizationError
from quantlab.formats import grouping
from quantlab.nn import QuantizedLinear
from quantlab.nn.kinds import as_linear, is_quantizable_linear
from quantlab.nn.rotation import input_rotation_block, rotate
from quantlab.solvers import InputStats
from quantlab.utils.allocator import return_freed_memory

if TYPE_CHECKING:
    from quantlab.plan import QuantizationPlan

BATCH_SIZE = 8


@torch.no_grad()
def quantize_blocks(
    model: nn.Module,
    plan: "QuantizationPlan",
    windows: torch.Tensor,
    progress: bool = True,
    weights: BlockWeights | None = None,
    activations: Activations | None = None,
) -> list[str]:
    """Quantize the plan's layers inside the model's blocks in place; returns their names.

    A fused experts module is calibrated expert by expert (`quantlab.calibration.experts`).
    `weights`: where the blocks' weights are (default: in the model); a streamed model reads each
    block when its turn comes and writes it out when it is quantized (`weights.store`).
    `activations`: where the blocks' inputs and outputs wait (default: in memory; or on disk)."""
    config, module_class, selected = plan.config, plan.module_class, plan.selects
    weights, keep = weights or BlockWeights(), (activations or Activations()).keep
    prefix, blocks = find_blocks(model)
    batches = first_block_inputs(
        model, blocks[0], distributed.share_of_windows(windows, BATCH_SIZE), BATCH_SIZE, activations
    )
    reconstruction = BlockReconstruction.for_config(config, batches)  # None unless the solver trains blocks
    if reconstruction is not None and distributed.world_size() > 1:
        raise QuantizationError(f"the {config.solver} solver trains each block in one process; run it without torchrun")
    converted: list[str] = []
    description = f"calibrating ({config.solver}{' + awq' if config.awq else ''})"
    bar = tqdm(blocks, desc=description, disable=not (progress and distributed.is_main()))
    for index, block in enumerate(bar):
        weights.load(index, block)
        unfused = unfuse_experts(block, f"{prefix}.{index}", plan) if not weights.finished(index) else {}
        names = selected_linears(block, f"{prefix}.{index}", selected)
        if not names or weights.finished(index):
            if reconstruction is not None:
                reconstruction.skip(block, batches, resumed=bool(names))
            batches = [keep(run_block(block, batch), batch.kwargs) for batch in batches]
            weights.store(index, block)
            converted += names.values()
            continue
        as_linears(block, names)
        if config.awq:
            scale_block(block, batches, names, _fake_quantizer(plan.config_for, module_class))
        if reconstruction is not None:
            reconstruction.prepare(block, names, batches)
        stats = collect_input_stats(block, names, batches)
        return_freed_memory()
        starving = starving_slices(unfused, names, stats)
        solved = {relative: name for relative, name in names.items() if relative not in starving}
        quantized = quantize_layers(block, solved, config, module_class, stats, plan.config_for)
        for relative, layer in quantized.items():
            linear = block.get_submodule(relative)
            linear.weight.copy_(layer.dequantize_weight(linear.weight.dtype))
        return_freed_memory()  # the solvers' temporaries
        if reconstruction is not None:
            outputs = reconstruction.refine(block, quantized, batches, progress, f"{prefix}.{index}")
            batches = [keep(output, batch.kwargs) for output, batch in zip(outputs, batches, strict=True)]
        else:
            batches = [keep(run_block(block, batch), batch.kwargs) for batch in batches]
        for relative, layer in quantized.items():
            block.set_submodule(relative, layer)
        fuse_experts(block, f"{prefix}.{index}", unfused, plan, starving)
        weights.store(index, block)
        converted += names.values()
    warn_data_free_experts(plan)
    return converted


def collect_input_stats(
    block: nn.Module, names: dict[str, str], batches: list[BlockInputs], outputs: list[torch.Tensor] | None = None
) -> dict[str, InputStats]:
    """Input statistics of each named Linear layer of `block` over all batches (shared by shared inputs),
    summed over the processes calibrating together; the block's outputs are appended to `outputs`
    when given (same pass)."""
    stats: dict[str, InputStats] = {}
    shares: dict[str, str] = {}
    seen: dict[int, tuple[str, torch.Tensor]] = {}  # the tensors are kept so their ids are not reused

    def hook_for(relative: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            inputs = args[0]
            first, _ = seen.setdefault(id(inputs), (relative, inputs))
            if first != relative:
                shares[relative] = first
                return
            if relative not in stats:  # (not `setdefault`: that would build an `in x in` matrix every batch)
                stats[relative] = InputStats(inputs.shape[-1])
            stats[relative].add(inputs)

        return hook

    handles = [block.get_submodule(relative).register_forward_hook(hook_for(relative)) for relative in names]
    try:
        # after each batch its inputs' ids are forgotten (the next batch's tensors may reuse them)
        kept = run_block_on_batches(block, batches, keep=outputs is not None, each=lambda index, output: seen.clear())
        if outputs is not None:
            outputs.extend(kept)
    finally:
        for handle in handles:
            handle.remove()
        seen.clear()
    for relative in names:  # the same distinct inputs, in the same order, on every rank
        if relative not in shares:
            if relative not in stats:  # no input reached it (an expert no token was routed to)
                stats[relative] = InputStats(block.get_submodule(relative).in_features)
            stats[relative].all_reduce()
    return {relative: stats[shares.get(relative, relative)] for relative in names}


def selected_linears(block: nn.Module, prefix: str, selected: Callable[[str], bool]) -> dict[str, str]:
    """Relative name → full name of the block's float Linear layers that `selected` (the plan) quantizes."""
    return {
        relative: f"{prefix}.{relative}"
        for relative, module in block.named_modules()
        if is_quantizable_linear(module) and selected(f"{prefix}.{relative}")
    }


def as_linears(block: nn.Module, names: dict[str, str]) -> None:
    """Put each named layer of `block` in place as an `nn.Linear` computing the same (GPT-2's `Conv1D`: the Linear
    of its transposed weight, sharing its tensors), so AWQ, the solvers and the block's runs read one kind."""
    for relative in names:
        module = block.get_submodule(relative)
        linear = as_linear(module)
        if linear is not module:
            block.set_submodule(relative, linear)


def _fake_quantizer(
    config_for: Callable[[str], QuantlabConfig], module_class: type[QuantizedLinear]
) -> Callable[[torch.Tensor, str], torch.Tensor]:
    """(weight, layer name) → the weight's round-to-nearest dequantized copy on the layer's grid, in the
    layer's input space (a rotated layer's grid holds `W R`): what AWQ's search scores."""

    def fake_quantize(weight: torch.Tensor, layer: str) -> torch.Tensor:
        layer_config = config_for(layer)
        layout = module_class.layout_for(weight.shape[1], weight.shape[0], layer_config)
        rotation = input_rotation_block(weight.shape[1], layer_config)
        stored = rotate(weight.float(), rotation) if rotation else weight.float()
        grouped = grouping.group(stored, layout.group_size)
        params = layout.fit(grouped)
        codes = layout.quantize_grouped(grouped, params)
        zero = None if params.zero is None else params.zero.unsqueeze(-1)
        values = grouping.ungroup(layout.decode(codes, params.scale.unsqueeze(-1), zero), weight.shape[1])
        return (rotate(values, rotation) if rotation else values).to(weight.dtype)

    return fake_quantize
