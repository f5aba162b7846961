"""`target_modules="all-linear"` selects quantlab's quantized layers too.

PEFT resolves the shorthand in `tuners_utils._maybe_include_all_linear_layers`, which keeps
only `nn.Linear` and `Conv1D` modules (bitsandbytes' layers subclass `nn.Linear`; quantlab's
store no float weight and do not). The wrapper adds every `QuantizedLinear` to PEFT's answer,
leaving out what PEFT leaves out for float models: the output head (`get_output_embeddings()`,
or a classification head for sequence-classification tasks) and layers inside an adapter.
"""

from collections.abc import Callable
from typing import Any

from torch import nn

from quantlab.integrations.patching import wrap
from quantlab.nn import QuantizedLinear

ALL_LINEAR = "all-linear"


def patch_all_linear(tuners_utils: Any) -> None:
    wrap(tuners_utils, "_maybe_include_all_linear_layers", _include_quantized_layers)


def quantized_targets(model: nn.Module, task_type: Any = None) -> set[str]:
    """Names of the quantized layers "all-linear" stands for in `model`."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.constants import SEQ_CLS_HEAD_NAMES
    from peft.utils.peft_types import TaskType

    heads: list[nn.Module] = []
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None:
        heads.append(output)
    elif task_type == TaskType.SEQ_CLS:
        heads += [getattr(model, name) for name in SEQ_CLS_HEAD_NAMES if getattr(model, name, None) is not None][:1]
    inside_adapters = [name + "." for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]
    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear)
        and not any(module is head for head in heads)
        and not any(name.startswith(prefix) for prefix in inside_adapters)
    }


def _include_quantized_layers(original: Callable[..., Any]) -> Callable[..., Any]:
    def _maybe_include_all_linear_layers(peft_config: Any, model: nn.Module) -> Any:
        target = getattr(peft_config, "target_modules", None)
        asked = isinstance(target, str) and target.lower() == ALL_LINEAR
        peft_config = original(peft_config, model)
        if asked:
            found = quantized_targets(model, getattr(peft_config, "task_type", None))
            if found:
                peft_config.target_modules = set(peft_config.target_modules) | found
        return peft_config

    return _maybe_include_all_linear_layers
