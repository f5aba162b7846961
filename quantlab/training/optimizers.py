"""Optimizers and learning-rate schedules by name.

| name | implementation | state per trained weight |
| --- | --- | --- |
| `adamw_torch` | `torch.optim.AdamW` | 8 bytes (two fp32 moments) |
| `adamw_8bit` | `bitsandbytes.optim.AdamW8bit` (block-wise 8-bit moments, arXiv 2110.02861) | about 2 bytes |
| `paged_adamw_8bit` | `bitsandbytes.optim.PagedAdamW8bit` (state in paged memory; plain on CPU) | about 2 bytes |
| `lion_8bit` | `bitsandbytes.optim.Lion8bit` (one 8-bit moment, arXiv 2302.06675) | about 1 byte |
| `adafactor` | `transformers.optimization.Adafactor` (factored second moment, arXiv 1804.04235) | rows + columns |

Weight decay applies to matrices only, not to biases and norm weights. bitsandbytes keeps
fp32 state for tensors under 4096 elements (`min_8bit_size`).
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from quantlab.errors import QuantlabError

OptimizerFactory = Callable[..., torch.optim.Optimizer]


class UnknownOptimizerError(QuantlabError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def _adamw_torch(params: Any, lr: float, weight_decay: float, **options: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **options)


def _bitsandbytes(class_name: str) -> OptimizerFactory:
    def build(params: Any, lr: float, weight_decay: float, **options: Any) -> torch.optim.Optimizer:
        try:
            import bitsandbytes
        except ImportError as error:
            raise QuantlabError(
                f"optimizer {class_name} needs bitsandbytes; pip install 'quantlab[compare]' installs it, "
                f"or choose adamw_torch / adafactor"
            ) from error
        return getattr(bitsandbytes.optim, class_name)(params, lr=lr, weight_decay=weight_decay, **options)

    return build


def _adafactor(params: Any, lr: float, weight_decay: float, **options: Any) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    settings = {"scale_parameter": False, "relative_step": False, "warmup_init": False, **options}
    return Adafactor(params, lr=lr, weight_decay=weight_decay, **settings)


OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adamw_torch": _adamw_torch,
    "adamw_8bit": _bitsandbytes("AdamW8bit"),
    "paged_adamw_8bit": _bitsandbytes("PagedAdamW8bit"),
    "lion_8bit": _bitsandbytes("Lion8bit"),
    "adafactor": _adafactor,
}


def optimizer_names() -> list[str]:
    return sorted(OPTIMIZERS)


def check_optimizer_name(name: str) -> None:
    if name not in OPTIMIZERS:
        raise UnknownOptimizerError(f"unknown optimizer {name!r}; known optimizers: {', '.join(optimizer_names())}")


def build_optimizer(
    name: str,
    parameters: Iterable[tuple[str, nn.Parameter]],
    lr: float,
    weight_decay: float = 0.0,
    **options: Any,
) -> torch.optim.Optimizer:
    """The optimizer `name` over the trainable `(name, parameter)` pairs given."""
    check_optimizer_name(name)
    trainable = [(n, p) for n, p in parameters if p.requires_grad]
    if not trainable:
        raise QuantlabError("the model has no trainable parameter: add LoRA adapters or unfreeze some weights")
    decayed = [p for n, p in trainable if p.dim() >= 2]
    not_decayed = [p for n, p in trainable if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": weight_decay}]
    if not_decayed:
        groups.append({"params": not_decayed, "weight_decay": 0.0})
    return OPTIMIZERS[name](groups, lr=lr, weight_decay=weight_decay, **options)


def build_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    **options: Any,
) -> torch.optim.lr_scheduler.LRScheduler:
    """`transformers.get_scheduler`, counted in optimizer steps."""
    from transformers import get_scheduler

    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup_steps,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=options or None,
    )


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (moments, quantization maps, absmax), each counted once."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel():
                pointer = value.untyped_storage().data_ptr()
                if pointer not in seen:
                    seen.add(pointer)
                    total += value.untyped_storage().nbytes()
    return total
