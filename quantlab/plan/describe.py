"""A plan as text for people: one line per layer, runs of equal layers across blocks folded together."""

import re
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

from quantlab.plan.plan import PlannedLayer, QuantizationPlan

_BLOCK_INDEX = re.compile(r"\.(\d+)\.")
T = TypeVar("T")


def describe_plan(plan: QuantizationPlan) -> str:
    """The plan in lines: its solver and data, the layers (equal ones in every block shown once, with the
    block range), the vocabulary tables, and what stays in float."""
    config = plan.config
    lines = [f"method {config.method}, solver {plan.solver.name}" + (" + awq" if config.awq else "")]
    if plan.calibration is not None:
        lines.append(f"calibration: {plan.calibration}")
    if plan.allocates:
        lines.append(
            f"mixed precision: widths and groups chosen within {config.target_bits} bits per weight after measuring "
            f"each layer on the calibration windows (layers marked *)"
        )
    lines.append(f"{len(plan.layers)} layers quantized ({100 * plan.quantized_share():.1f} % of the weights outside "
                 f"the vocabulary):")  # fmt: skip
    for pattern, indices, layer in _folded(plan.layers, _layer_text):
        lines.append(f"  {_where(pattern, indices)}  {_layer_text(layer)}")
    if plan.tables:
        lines.append(f"vocabulary tables in {config.embedding_bits} bits: {', '.join(plan.tables)}")
    kept = {weight.name: weight for weight in plan.left_float if weight.chosen}
    for pattern, indices, weight in _folded(kept, lambda weight: weight.why):
        lines.append(f"kept in float: {_where(pattern, indices)} ({weight.why})")
    unhandled = {weight.name: weight for weight in plan.unhandled()}
    for pattern, indices, weight in _folded(unhandled, lambda weight: f"{weight.shape}{weight.why}"):
        shape = " x ".join(map(str, weight.shape))
        lines.append(f"LEFT IN FLOAT: {_where(pattern, indices)} [{shape}]: {weight.why}")
    for name, why in plan.data_free_experts.items():
        lines.append(f"data-free expert: {name}: {why}")
    return "\n".join(lines)


def _layer_text(layer: PlannedLayer) -> str:
    shape = f"{layer.out_features}x{layer.in_features}"
    if layer.layout is None:
        return f"{shape}  {layer.config.method}  solver {layer.solver}"
    layout = layer.layout
    group = "channel" if layout.group_size is None else f"g{layout.group_size}"
    parts = [shape, layout.codec, f"{layout.bits}-bit", group, f"{layout.bits_per_weight():.3f} b/w", layer.solver]
    if layer.config.input_rotated:
        parts.append(f"rotated ({layer.config.rotation_blocks})")
    if layer.allocated:
        parts.append("*")
    return "  ".join(parts)


def _where(pattern: str, indices: list[int]) -> str:
    """The name with its block index, or the range of block indices it stands for."""
    return pattern.replace("{i}", str(indices[0]) if len(indices) == 1 else f"{{{_ranges(indices)}}}")


def _folded(entries: dict[str, T], text: Callable[[T], str]) -> list[tuple[str, list[int], T]]:
    """(name with the block index as `{i}`, the block indices, an entry) for each run of entries whose names
    differ only in their block index and whose `text` is the same; entries outside the blocks keep their own line."""
    groups: dict[tuple[str, str], list[tuple[int, T]]] = defaultdict(list)
    for name, entry in entries.items():
        match = _BLOCK_INDEX.search(name)
        if match is None:
            key, index = (name, text(entry)), 0
        else:
            key = (name[: match.start()] + ".{i}." + name[match.end() :], text(entry))
            index = int(match.group(1))
        groups[key].append((index, entry))
    return [(key[0], [index for index, _ in members], members[0][1]) for key, members in groups.items()]


def _ranges(indices: list[int]) -> str:
    """`0-3,5` for [0, 1, 2, 3, 5]."""
    runs: list[list[int]] = []
    for index in sorted(indices):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
