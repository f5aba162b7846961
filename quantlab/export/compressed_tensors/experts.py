"""The per-expert Linear layers transformers names a mixture of experts' fused projections as in a checkpoint.

compressed-tensors stores Linear layers, and transformers' compressed-tensors loader reads a mixture's
experts as one layer per expert and projection (`experts.3.gate_proj`; Mixtral's `w1`), which its
checkpoint conversion merges into the fused `gate_up_proj` / `down_proj` it computes with. The names and
the rows each layer takes are asked of transformers' own reverse conversion, not written here.
"""

import bisect
from dataclasses import dataclass

import torch
from torch import nn

from quantlab.export.compressed_tensors.errors import CompressedTensorsExportError
from quantlab.nn.quantized_experts import QuantizedExperts


@dataclass(frozen=True)
class ExpertLayer:
    """One per-expert Linear layer of the checkpoint (`...experts.3.gate_proj`): the rows of one expert's slice of a
    fused projection it holds."""

    name: str
    projection: str
    expert: int
    rows: slice


@dataclass(frozen=True)
class _Probe:
    """The row numbers `first ..` of one fused projection, `rows` to an expert, in the probe given to transformers."""

    module: str
    projection: str
    first: int
    rows: int


def checkpoint_expert_layers(model: nn.Module) -> dict[str, list[ExpertLayer]]:
    """The per-expert Linear layers transformers saves each quantized experts module's projections as (and loads them
    from), by module name.

    transformers' own reverse conversion (`revert_weight_conversion`, what `save_pretrained` runs) is applied to one
    probe per projection, `[experts, rows, 1]` numbering every row of the model's fused projections: each tensor it
    returns names a checkpoint Linear layer and holds the numbers of the rows it takes, so the names and the split
    of gate and up are the model's own conversion mapping's.
    """
    modules = {name: module for name, module in model.named_modules() if isinstance(module, QuantizedExperts)}
    if not modules:
        return {}
    probes: list[_Probe] = []
    tensors: dict[str, torch.Tensor] = {}
    first = 0
    for name, module in modules.items():
        for projection, layout in module.layouts.items():
            probes.append(_Probe(name, projection, first, layout.out_features))
            count = module.num_experts * layout.out_features
            numbers = torch.arange(first, first + count, dtype=torch.float64)
            tensors[f"{name}.{projection}"] = numbers.reshape(module.num_experts, layout.out_features, 1)
            first += count
    layers: dict[str, list[ExpertLayer]] = {name: [] for name in modules}
    firsts = [probe.first for probe in probes]
    for key, numbers in _reverted(model, tensors, next(iter(modules))).items():
        probe = probes[bisect.bisect_right(firsts, int(numbers.flatten()[0])) - 1]
        layers[probe.module].append(_expert_layer(key, numbers, probe))
    return layers


def _expert_layer(key: str, numbers: torch.Tensor, probe: _Probe) -> ExpertLayer:
    """The checkpoint layer `key` (a `.weight`) holding the probe rows `numbers`: whole rows of one expert, in order."""
    first, count = int(numbers.flatten()[0]), numbers.numel()
    expert, row = divmod(first - probe.first, probe.rows)
    expected = torch.arange(first, first + count, dtype=torch.float64).reshape(count, 1)
    if not key.endswith(".weight") or row + count > probe.rows or not torch.equal(numbers, expected):
        raise CompressedTensorsExportError(_not_per_expert(f"{probe.module}.{probe.projection}"))
    return ExpertLayer(key.removesuffix(".weight"), probe.projection, expert, slice(row, row + count))


def _reverted(model: nn.Module, probes: dict[str, torch.Tensor], first: str) -> dict[str, torch.Tensor]:
    """`probes` (fused experts projections by name) as transformers would save them; refused when it keeps them
    fused or cannot reverse the model's conversions."""
    try:
        reverted = as_saved(model, dict(probes))
    except (ValueError, KeyError, RuntimeError) as error:
        raise CompressedTensorsExportError(
            f"{first}: transformers cannot name its experts' per-expert checkpoint layers ({error})"
        ) from None
    total = sum(probe.numel() for probe in probes.values())
    fused = [key for key in reverted if key in probes]
    if fused or sum(tensor.numel() for tensor in reverted.values()) != total:
        raise CompressedTensorsExportError(_not_per_expert(fused[0] if fused else first))
    return reverted


def as_saved(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` named as transformers saves a model of this class built anew: its class's conversion mapping
    reversed, whatever checkpoint the model was loaded from (one with fused experts records no conversion, and
    transformers would then keep the fused names, which its compressed-tensors loader does not read)."""
    from transformers.core_model_loading import revert_weight_conversion

    recorded = model.__dict__.pop("_weight_conversions", None)
    try:
        return revert_weight_conversion(model, state)
    finally:
        if recorded is not None:
            model._weight_conversions = recorded


def _not_per_expert(projection: str) -> str:
    return (
        f"{projection} cannot be written as compressed-tensors: transformers does not save this model's experts as "
        f"one Linear layer per expert and projection, the only way compressed-tensors stores them; export the "
        f"dequantized model (quantlab.dequantize) instead"
    )
