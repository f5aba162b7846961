"""Counting what a model holds: quantized and float Linear layers, parameters, peak memory."""

import resource
import sys
from dataclasses import dataclass, field

from torch import nn

from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_embedding import QuantizedTable, TiedOutputHead
from quantlab.nn.quantized_experts import QuantizedExperts


@dataclass(frozen=True)
class LayerSummary:
    quantized: list[str]
    kept: list[str]  # Linear layers left in float
    tables: list[str] = field(default_factory=list)  # quantized vocabulary tables; a tied head as "lm_head (tied)"
    # Layers whose group size does not divide their inputs: name -> (inputs, group size, codes stored a row)
    padded: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    def describe(self, shown: int = 3) -> str:
        kept = f"{len(self.kept)} kept in float"
        if self.kept:
            names = ", ".join(self.kept[:shown]) + (", ..." if len(self.kept) > shown else "")
            kept += f" ({names})"
        tables = f"; quantized tables: {', '.join(self.tables)}" if self.tables else ""
        return f"{len(self.quantized)} quantized, {kept}{tables}"


def layer_summary(model: nn.Module) -> LayerSummary:
    quantized, kept, tables, padded = [], [], [], {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            quantized.append(name)
            layout = module.layout
            if layout.groups * layout.group_length != layout.in_features:
                padded[name] = (layout.in_features, layout.group_length, layout.groups * layout.group_length)
        elif isinstance(module, QuantizedExperts):
            quantized += [f"{name}.{projection}" for projection in module.layouts]
        elif isinstance(module, QuantizedTable):
            tables.append(f"{name} ({module.layout.bits}-bit)")
        elif isinstance(module, TiedOutputHead):
            tables.append(f"{name} (tied)")
        elif isinstance(module, nn.Linear):
            kept.append(name)
    return LayerSummary(quantized, kept, tables, padded)


def parameter_count(model: nn.Module) -> int:
    """Parameters of the float model: float parameters plus the weights quantized layers and tables encode
    (a tied head encodes none of its own, as a tied float head adds no parameter)."""
    floats = sum(parameter.numel() for parameter in model.parameters())
    encoded = sum(
        m.in_features * m.out_features
        for m in model.modules()
        if isinstance(m, (QuantizedLinear, QuantizedTable, QuantizedExperts))
    )
    return floats + encoded


def peak_memory_bytes() -> int:
    """Peak resident memory of this process so far (`getrusage` ru_maxrss)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes
