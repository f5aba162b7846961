"""The reference kernel: dequantize the weight, then a float matmul.

With gradients enabled the matmul runs inside an autograd function that dequantizes again
in the backward pass instead of saving the float weight: the activation gradient of a
frozen quantized layer (QLoRA) then costs no weight-sized memory per layer.
"""

import torch
import torch.nn.functional as F

from quantlab.kernels import ANY, register_kernel


class _DequantizeMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, module) -> torch.Tensor:  # type: ignore[override]
        ctx.module = module
        return F.linear(x, module.dequantize_weight(x.dtype))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        weight = ctx.module.dequantize_weight(grad_output.dtype)
        return grad_output @ weight, None


@register_kernel(ANY, ANY)
def dequantize_matmul(module, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        out = _DequantizeMatmul.apply(x, module)
    else:
        out = F.linear(x, module.dequantize_weight(x.dtype))
    if module.bias is not None:
        out = out + module.bias.to(out.dtype)
    return out
