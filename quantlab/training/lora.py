"""LoRA adapters on float, quantlab-quantized and bitsandbytes models: PEFT's, with quantlab's defaults.

PEFT knows quantlab's quantized layers out of the box (`quantlab.integrations.peft`: its LoRA
layer, and `target_modules="all-linear"` selecting them, the output head left out), so this is
`get_peft_model(model, LoraConfig(...))` with a causal-LM task, plus a check PEFT lacks (every
target name given must match a layer). Save and reload with PEFT: `model.save_pretrained(folder)`,
`PeftModel.from_pretrained(base, folder)` (the base quantized as it was for training).
"""

from torch import nn

import quantlab.integrations.peft  # noqa: F401  (registers quantlab's LoRA layer with PEFT)
from quantlab.errors import QuantlabError
from quantlab.nn import QuantizedLinear


def add_lora(
    model: nn.Module,
    r: int = 16,
    alpha: float = 32,
    dropout: float = 0.05,
    target_modules: str | list[str] = "all-linear",
    **lora_options: object,
) -> nn.Module:
    """Wrap the target layers of `model` with fresh LoRA adapters; returns the `PeftModel`."""
    from peft import LoraConfig, get_peft_model

    if r < 1:
        raise QuantlabError(f"LoRA rank r={r} must be >= 1")
    _check_targets(model, target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        task_type="CAUSAL_LM", **lora_options)  # fmt: skip
    return get_peft_model(model, config)


def _check_targets(model: nn.Module, target_modules: str | list[str]) -> None:
    """Every name given must match a layer (PEFT only refuses a list of which none matches)."""
    if isinstance(target_modules, str):
        return
    linear = sorted(
        {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantizedLinear))}
    )
    for target in target_modules:
        if not any(name == target or name.endswith("." + target) for name, _ in model.named_modules()):
            raise QuantlabError(
                f"LoRA target module {target!r} matches no Linear layer of {type(model).__name__}; its Linear "
                f"layers are named {', '.join(linear)} (or pass 'all-linear')"
            )
