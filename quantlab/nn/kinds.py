"""Which module kinds quantlab quantizes, and how it names the weights of the kinds it does not.

A module is a quantizable Linear layer when it computes `x W^T + b`: `nn.Linear` itself, a subclass
that keeps its forward, a subclass registered here as computing the same (transformers' `FalconLinear`),
or a class registered as storing `W` transposed, `[in, out]` (transformers' `Conv1D`, GPT-2's projections).
A transposed layer is quantized as the Linear layer of `W`: `as_linear` views it as one and
`linear_weight` turns its checkpoint tensor into `W`, so this module alone knows the transpose.
Every other weight of two or more dimensions that a plan leaves in float is described by
`unhandled_kind`, so a report can name it rather than skip it in silence: a Linear subclass with a
forward of its own, or a 3-D parameter (transformers 5 stores a mixture of experts' projections as one
`[experts, out, in]` tensor).
"""

import torch
from torch import nn

# Linear subclasses whose own forward computes exactly `x W^T + b`, by "module.QualifiedName".
_SAME_AS_LINEAR: set[str] = {"transformers.models.falcon.modeling_falcon.FalconLinear"}
# Classes computing `x W + b` with `weight` `[in, out]` and `bias` `[out]` (or None), by "module.QualifiedName".
_TRANSPOSED: set[str] = {"transformers.pytorch_utils.Conv1D"}


def register_linear_kind(cls: type[nn.Module], transposed: bool = False) -> type[nn.Module]:
    """Declare that layers of `cls` are quantized like `nn.Linear` (a decorator; a subclass that keeps
    `nn.Linear.forward` needs no registration): an `nn.Linear` subclass whose forward computes `x W^T + b`,
    or, with `transposed`, a module computing `x W + b` from its `weight` `[in, out]` and `bias`."""
    base = nn.Module if transposed else nn.Linear
    if not (isinstance(cls, type) and issubclass(cls, base)):
        what = "an nn.Module class" if transposed else "an nn.Linear subclass"
        raise TypeError(f"register_linear_kind takes {what}, not {cls!r}")
    (_TRANSPOSED if transposed else _SAME_AS_LINEAR).add(_qualified(cls))
    return cls


def is_quantizable_linear(module: nn.Module) -> bool:
    """Whether `module` is a Linear layer quantlab's quantized layers can stand in for."""
    if is_transposed_linear(module):
        return True
    if not isinstance(module, nn.Linear):
        return False
    cls = type(module)
    return cls is nn.Linear or cls.forward is nn.Linear.forward or _qualified(cls) in _SAME_AS_LINEAR


def is_transposed_linear(module: nn.Module) -> bool:
    """Whether `module` is a registered Linear layer storing its weight `[in, out]` (GPT-2's `Conv1D`)."""
    return _qualified(type(module)) in _TRANSPOSED


def linear_weight(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The `[out, in]` weight `W` of a quantizable layer's `weight` tensor (a view); the inverse too, as
    transposing twice is the identity: a `[out, in]` weight in the layout the layer stores."""
    return weight.T if transposed else weight


def as_linear(module: nn.Module) -> nn.Linear:
    """`module` (a quantizable Linear layer) as an `nn.Linear` computing the same: itself, or for a transposed
    layer one sharing its weight (`W` as a view of the `[in, out]` tensor) and its bias, so writing either
    layer's weight writes both."""
    if not is_transposed_linear(module):
        return module
    weight = linear_weight(module.weight.data, transposed=True)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    if module.bias is not None:
        linear.bias = module.bias
    return linear


def unhandled_kind(module: nn.Module, attribute: str, dimensions: int) -> str:
    """A short name for a float weight no quantized module handles (for reports)."""
    cls = type(module).__name__
    if isinstance(module, nn.Linear):
        return f"{cls} (an nn.Linear subclass with its own forward)"
    if dimensions >= 3:
        return f"{dimensions}-D parameter of {cls}"
    return f"{cls}.{attribute}"


def is_router(module: nn.Module, name: str) -> bool:
    """Whether `module` is a mixture of experts' router (not an `nn.Linear`: transformers 5's `...TopKRouter`),
    which every peer keeps in float: its `[experts, hidden]` weight is small and chooses the experts."""
    if isinstance(module, nn.Linear):
        return False
    return type(module).__name__.lower().endswith("router") or name.rpartition(".")[2] in ("gate", "router")


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def fused_experts_shape(module: nn.Module) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of a fused experts module (`is_fused_experts`)."""
    experts, _, hidden = module.gate_up_proj.shape
    return experts, hidden, module.down_proj.shape[2]


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` holds a mixture of experts' MLPs as transformers 5 fuses them, in the layout
    `QuantizedExperts` computes: `gate_up_proj` `[experts, 2 * intermediate, hidden]` (gate rows first, then
    up), `down_proj` `[experts, hidden, intermediate]`, no biases, `act_fn(gate) * up` between them."""
    parameters = dict(module.named_parameters(recurse=False))
    if set(parameters) != {"gate_up_proj", "down_proj"} or not isinstance(getattr(module, "act_fn", None), nn.Module):
        return False
    gate_up, down = parameters["gate_up_proj"], parameters["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
        return False
    experts, double, hidden = gate_up.shape
    if tuple(down.shape) != (experts, hidden, double // 2):
        return False
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}
    if any(getattr(module, flag, default) != default for flag, default in flags.items()):
        return False
    if getattr(module, "has_post_expert_norm", False):
        return False
    return _standard_gate(type(module))


def _standard_gate(cls: type) -> bool:
    """The class gates as transformers' default does (`act_fn(gate) * up`), or declares no gate of its own."""
    gate = getattr(cls, "_apply_gate", None)
    if gate is None:
        return True
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    return gate is _default_apply_gate
