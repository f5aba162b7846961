"""Which layers pruning touches: every float `nn.Linear` but the output head (and LoRA adapters), unless named.

The output head (`lm_head`, often tied to the input embeddings) is left dense by default: it
is one matrix whose every row is a token's logit, and pruning it hurts far more than its share
of the weights (SparseGPT and Wanda, arXiv 2301.00774 and 2306.11695, leave it dense too).
"""

from torch import nn

from quantlab.nn import QuantizedLinear
from quantlab.prune.patterns import PruningError


def prunable_layers(model: nn.Module, modules: list[str] | None = None) -> dict[str, nn.Linear]:
    """`modules` by name (each must be a float `nn.Linear`), or by default every Linear but the output head."""
    named = dict(model.named_modules())
    if modules is not None:
        return {name: _checked(model, named, name) for name in modules}
    _refuse_quantized(model)
    skipped = _output_head_names(model, named)
    return {
        name: module
        for name, module in named.items()
        if isinstance(module, nn.Linear) and name not in skipped and "lora_" not in name  # adapters stay dense
    }


def _checked(model: nn.Module, named: dict[str, nn.Module], name: str) -> nn.Linear:
    module = named.get(name)
    if module is None:
        raise PruningError(f"no module named {name!r} in {type(model).__name__}; check the name")
    if isinstance(module, QuantizedLinear):
        raise PruningError(f"{name} is quantized; prune the float model first, then quantize it")
    if not isinstance(module, nn.Linear):
        raise PruningError(f"{name} is a {type(module).__name__}, not an nn.Linear layer; name its Linear sub-layers")
    return module


def _refuse_quantized(model: nn.Module) -> None:
    quantized = [name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    if quantized:
        raise PruningError(
            f"{type(model).__name__} is quantized ({len(quantized)} layers, e.g. {quantized[0]}); prune the float "
            f"model first, then quantize it: pruned weights stay zero through quantization"
        )


def _output_head_names(model: nn.Module, named: dict[str, nn.Module]) -> set[str]:
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return {name for name, module in named.items() if head is not None and module is head}
