"""Model tensors that transformers builds from differently named checkpoint tensors, read one target at a time.

transformers 5 renames some checkpoint tensors as it loads them and merges others: a mixture of
experts' per-expert weights (`experts.3.gate_proj.weight`, `experts.3.up_proj.weight`, ...) become
one fused parameter (`experts.gate_up_proj`, stacked over the experts, gate and up concatenated).
`CheckpointConversion` applies the model's own conversion mapping (`get_model_conversion_mapping`,
the loader's `rename_source_key` and the converters' operations) to the checkpoint's names, so a
streamed read of one model tensor reads exactly its sources and builds what `from_pretrained`
would: the fused experts of one block, never the whole model.
"""

import copy
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class CheckpointConversion:
    """For each model tensor the checkpoint holds under other names: its sources and how to combine them."""

    def __init__(self, model: nn.Module, checkpoint_names: list[str]) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        self.model = model
        mapping = get_model_conversion_mapping(model) or []
        renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
        converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
        by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        expected = set(model.state_dict())
        prefix = getattr(model, "base_model_prefix", None)
        self.sources: dict[str, list[tuple[str, str]]] = defaultdict(list)  # target -> [(checkpoint name, pattern)]
        self.converters: dict[str, Any] = {}
        for name in sorted(checkpoint_names, key=_natural_key):
            if name in expected:
                continue
            target, pattern = rename_source_key(name, renamings, converters, prefix, dict.fromkeys(expected))
            if target not in expected:
                continue
            self.sources[target].append((name, pattern or name))
            if pattern is not None:
                self.converters[target] = by_pattern[pattern]

    def __contains__(self, target: str) -> bool:
        return target in self.sources

    def source_names(self, target: str) -> list[str]:
        return [name for name, _ in self.sources[target]]

    def read(self, target: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The model tensor `target` built from its checkpoint tensors (`read(name)` reads one)."""
        sources = self.sources[target]
        template = self.converters.get(target)
        if template is None:  # renamed only
            (name, _), *rest = sources
            if rest:
                raise ValueError(f"{target}: several checkpoint tensors rename to it ({name}, {rest[0][0]})")
            return read(name)
        converter = copy.deepcopy(template)
        for name, pattern in sources:
            converter.add_tensor(target, name, pattern, read(name))
        converted = converter.convert(target, model=self.model, config=self.model.config)
        value = converted[target]
        return value[0] if isinstance(value, list) else value


def _natural_key(name: str) -> list[Any]:
    """Sort key putting `experts.2` before `experts.10`, as the loader orders the tensors it merges."""
    return [int(part) if part.isdigit() else part for part in name.split(".")]
