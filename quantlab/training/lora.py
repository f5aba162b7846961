"""Adding, saving and reloading LoRA adapters on float, quantlab-quantized and bitsandbytes models.

`add_lora` wraps PEFT's `get_peft_model` with two things PEFT lacks here: `"all-linear"`
finds quantlab's quantized layers too (PEFT's own shortcut only looks for `nn.Linear`), and
target names that match no layer are refused with the names that do exist. quantlab's LoRA
layer is registered with PEFT on import (`quantlab.integrations.peft`), so reloading a saved
adapter only needs quantlab imported.
"""

import os
from pathlib import Path

from torch import nn

import quantlab.integrations.peft  # noqa: F401  (registers quantlab's LoRA layer with PEFT)
from quantlab.errors import QuantlabError
from quantlab.nn import QuantizedLinear

ALL_LINEAR = "all-linear"


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Layers LoRA can wrap: float, quantlab and bitsandbytes Linear layers, less the output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, QuantizedLinear)) and module is not head and "lora_" not in name
    }


def resolve_target_modules(model: nn.Module, target_modules: str | list[str]) -> list[str]:
    """Leaf names to wrap: `"all-linear"` → every projection's name; a list is checked against the model."""
    layers = linear_layers(model)
    leaf_names = sorted({name.rpartition(".")[2] for name in layers})
    if target_modules == ALL_LINEAR:
        if not leaf_names:
            raise QuantlabError(f"{type(model).__name__} has no Linear layer for LoRA to wrap")
        return leaf_names
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    for target in target_modules:
        matches = [name for name in layers if name == target or name.endswith("." + target)]
        if not matches:
            raise QuantlabError(
                f"LoRA target module {target!r} matches no Linear layer of {type(model).__name__}; "
                f"its Linear layers are named {', '.join(leaf_names)} (or pass 'all-linear')"
            )
    return list(target_modules)


def add_lora(
    model: nn.Module,
    r: int = 16,
    alpha: float = 32,
    dropout: float = 0.05,
    target_modules: str | list[str] = ALL_LINEAR,
    **lora_options: object,
) -> nn.Module:
    """Wrap the target layers of `model` with fresh LoRA adapters; returns the `PeftModel`."""
    from peft import LoraConfig, get_peft_model

    if r < 1:
        raise QuantlabError(f"LoRA rank r={r} must be >= 1")
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=resolve_target_modules(model, target_modules),
        task_type="CAUSAL_LM",
        **lora_options,
    )
    return get_peft_model(model, config)


def save_adapter(model: nn.Module, directory: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the adapter weights and config (PEFT's format) atomically."""
    from quantlab.utils.atomic import atomic_directory

    directory = Path(directory)
    with atomic_directory(directory, overwrite=overwrite) as staging:
        model.save_pretrained(staging)
    return directory


def load_adapter(base_model: nn.Module, directory: str | os.PathLike, trainable: bool = False) -> nn.Module:
    """A saved adapter on `base_model` (the same base, quantized the same way, it was trained on)."""
    from peft import PeftModel

    directory = Path(directory)
    if not (directory / "adapter_config.json").is_file():
        raise QuantlabError(f"{directory} holds no adapter (adapter_config.json is missing)")
    return PeftModel.from_pretrained(base_model, directory, is_trainable=trainable)
