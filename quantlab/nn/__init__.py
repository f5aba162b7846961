"""Quantized modules."""

from quantlab.nn.quantized_linear import QuantizedLinear

__all__ = ["QuantizedLinear"]
