"""The reference kernel: dequantize the stored weight, then a float matmul.

With gradients enabled the matmul runs inside an autograd function that dequantizes again
in the backward pass instead of saving the float weight: the activation gradient of a
frozen quantized layer (QLoRA) then costs no weight-sized memory per layer.
"""

import torch
import torch.nn.functional as F

from quantlab.kernels import ANY, register_kernel


def _stored_weight(module, dtype: torch.dtype) -> torch.Tensor:
    """The float weight the stored tensors represent: a rotating layer's `W R`, since its input arrives rotated."""
    if getattr(module, "input_rotation", 0):
        return module.dequantize_stored(dtype)
    return module.dequantize_weight(dtype)


class _DequantizeMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, module) -> torch.Tensor:  # type: ignore[override]
        ctx.module = module
        return F.linear(x, _stored_weight(module, x.dtype))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        weight = _stored_weight(ctx.module, grad_output.dtype)
        return grad_output @ weight, None


@register_kernel(ANY, ANY)
def dequantize_matmul(module, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        out = _DequantizeMatmul.apply(x, module)
    else:
        out = F.linear(x, _stored_weight(module, x.dtype))
    if module.bias is not None:
        out = out + module.bias.to(out.dtype)
    return out
