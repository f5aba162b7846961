"""A frozen teacher whose Linear weights are held in 16 bits and computed with in float32.

A distillation teacher only runs forward. Holding its Linear weights in bfloat16 halves its memory
(on a 1.1B Llama 4.4 GB -> 2.3 GB); each layer casts its weight back to the activations' dtype for
its product, so the arithmetic stays float32 and runs at float32 speed on CPUs without bfloat16
instructions (where torch's bfloat16 matrix products run a slow fallback). What changes is the
teacher's weights, rounded to 8 bits of mantissa: its logits move by that rounding.

A float checkpoint is loaded memory-mapped: its tensors are pages of the safetensors files, resident once
touched and for as long as any tensor of the file is alive. Converting those tensors would touch every page
(a 1.1B teacher: 4.4 GB resident on top of its 2.2 GB copy). Given the checkpoint's `CheckpointReader`, each
Linear weight is read from its file into fresh memory instead and converted, and the few other tensors
(embeddings, norms) are copied: the mapped float32 weights are never touched, and the files' mappings go
once the last of their tensors is replaced.
"""

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from quantlab.utils.scratch import scratch

HELD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CompactLinear(nn.Module):
    """`nn.Linear`'s product with its weight held in a smaller dtype (a frozen teacher's layer)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight if weight is None else weight
        self.register_buffer("weight", weight.detach().to(dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if x.dtype != torch.float32:
            return F.linear(x, self.weight.to(x.dtype), bias)
        return F.linear(x, scratch("teacher.weight", tuple(self.weight.shape)).copy_(self.weight), bias)


def hold_linear_weights_in(model: nn.Module, dtype: torch.dtype, reader: Any = None) -> int:
    """Replace every `nn.Linear` of the frozen `model` by a `CompactLinear` holding its weight in `dtype`;
    a weight shared with another module (a tied output head) stays as it is. Returns the layers replaced.

    `reader`: the `quantlab.streaming.reader.CheckpointReader` of the folder `model` was loaded from; a
    weight whose module name it holds is read from the file rather than from the mapped tensor."""
    if dtype == torch.float32:
        return 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is not nn.Linear:
                for parameter in module.parameters(recurse=False):
                    parameter.data = parameter.data.clone()
                for name, buffer in module.named_buffers(recurse=False):
                    module._buffers[name] = buffer.clone()
    counts: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and counts.get(id(module.weight), 0) == 1:
            stored = f"{name}.weight"
            weight = reader.tensor(stored, dtype) if reader is not None and stored in reader else None
            if weight is not None and tuple(weight.shape) != tuple(module.weight.shape):
                weight = None
            model.set_submodule(name, CompactLinear(module, dtype, weight))
            replaced += 1
    return replaced
