"""How close a quantized tensor is to its reference."""

import torch


def sqnr(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: `10 log10(|ref|² / |ref - approx|²)`."""
    reference = reference.detach().double()
    noise = (reference - approximation.detach().double()).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(reference.pow(2).sum() / noise))
