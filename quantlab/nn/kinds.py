"""Which module kinds quantlab quantizes, and how it names the weights of the kinds it does not.

A module is a quantizable Linear layer when it is an `nn.Linear` whose forward is `x W^T + b`:
`nn.Linear` itself, a subclass that keeps its forward, or a subclass registered here as computing
the same (transformers' `FalconLinear`). Every other weight of two or more dimensions that a plan
leaves in float is described by `unhandled_kind`, so a report can name it rather than skip it in
silence: a Linear subclass with a forward of its own, GPT-2's `Conv1D`, or a 3-D parameter
(transformers 5 stores a mixture of experts' projections as one `[experts, out, in]` tensor).
"""

from torch import nn

# Linear subclasses whose own forward computes exactly `x W^T + b`, by "module.QualifiedName".
_SAME_AS_LINEAR: set[str] = {"transformers.models.falcon.modeling_falcon.FalconLinear"}


def register_linear_kind(cls: type[nn.Linear]) -> type[nn.Linear]:
    """Declare that the `nn.Linear` subclass `cls` computes `x W^T + b`, so its layers are quantized
    like `nn.Linear` (a decorator; a subclass that keeps `nn.Linear.forward` needs no registration)."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Linear)):
        raise TypeError(f"register_linear_kind takes an nn.Linear subclass, not {cls!r}")
    _SAME_AS_LINEAR.add(_qualified(cls))
    return cls


def is_quantizable_linear(module: nn.Module) -> bool:
    """Whether `module` is a Linear layer quantlab's quantized layers can stand in for."""
    if not isinstance(module, nn.Linear):
        return False
    cls = type(module)
    return cls is nn.Linear or cls.forward is nn.Linear.forward or _qualified(cls) in _SAME_AS_LINEAR


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
