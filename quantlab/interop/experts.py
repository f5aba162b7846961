"""A checkpoint's layers under the names of the model transformers builds from it, experts included.

transformers 5 holds a mixture of experts' MLPs as one module with two fused 3-D projections
(`gate_up_proj`, `down_proj`), while checkpoints (compressed-tensors ones among them) store one
Linear layer per expert and projection: `mlp.experts.3.gate_proj`, Mixtral's
`block_sparse_moe.experts.3.w1`. The model's own conversion mapping, the one transformers loads
the checkpoint with, says which fused projection each stored layer is merged into and how other
layers are renamed; quantlab's config names layers as the model does (an experts projection's
options are under `model.layers.0.mlp.experts.gate_up_proj`), so the importer asks that mapping.
"""

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from quantlab.interop.errors import ForeignCheckpointError
from quantlab.nn.kinds import is_fused_experts
from quantlab.nn.quantized_experts import PROJECTIONS

_EXPERTS_KEY = re.compile(r"(^|\.)experts\.")


@dataclasses.dataclass(frozen=True)
class ModelNames:
    """Checkpoint names → the model's: stored layers merged into a fused experts projection (`experts`),
    other layers the conversions rename (`renamed`), and the model's fused experts modules (`modules`)."""

    experts: dict[str, str] = dataclasses.field(default_factory=dict)  # checkpoint layer -> `module.projection`
    renamed: dict[str, str] = dataclasses.field(default_factory=dict)
    modules: tuple[str, ...] = ()

    def layer(self, name: str) -> str:
        """The model's name for the checkpoint layer `name`: its fused experts projection, or its renamed self."""
        return self.experts.get(name) or self.renamed.get(name, name)


def model_names(source: Path, keys: Iterable[str], layers: Iterable[str]) -> ModelNames:
    """How the model of the checkpoint `source` names its stored `layers` (quantized layers, names without the
    tensor) and its float tensors `keys`; the model is built on the meta device only when a key names experts."""
    keys, layers = list(keys), list(layers)
    if not any(_EXPERTS_KEY.search(name) for name in keys + layers):
        return ModelNames()
    model = _meta_model(source)
    modules = tuple(name for name, module in model.named_modules() if is_fused_experts(module))
    rename = _renamer(model)
    projections = {f"{module}.{projection}" for module in modules for projection in PROJECTIONS}
    experts, renamed = {}, {}
    for layer in layers:
        target = rename(f"{layer}.weight")
        if target in projections:
            experts[layer] = target
        elif target.removesuffix(".weight") != layer:
            renamed[layer] = target.removesuffix(".weight")
    for key in keys:
        target = rename(key)
        if target in projections:
            experts[key.removesuffix(".weight")] = target
        elif key.endswith(".weight") and target.endswith(".weight") and target != key:
            renamed[key.removesuffix(".weight")] = target.removesuffix(".weight")
    return ModelNames(experts, renamed, modules)


def _meta_model(source: Path) -> torch.nn.Module:
    """The model transformers builds for the checkpoint `source`, on the meta device (no memory, no weights)."""
    from transformers import AutoConfig

    from quantlab.utils.model_kind import model_class

    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
        cls = model_class(config)
        build = getattr(cls, "_from_config", None) or cls.from_config
        with torch.device("meta"):
            return build(config)
    except (ValueError, KeyError, OSError, TypeError, ImportError) as error:
        raise ForeignCheckpointError(
            f"{source} stores a mixture of experts, and transformers cannot build its model to name the experts' "
            f"layers ({_first_line(error)}); load it with transformers"
        ) from None


def _renamer(model: torch.nn.Module) -> Any:
    """A checkpoint key → the key the model loads it as (transformers' renamings, then at most one conversion)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    return lambda key: rename_source_key(key, renamings, converters, prefix, state)[0]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
