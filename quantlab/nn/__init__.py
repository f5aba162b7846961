"""Quantized modules."""

from quantlab.nn.quantized_embedding import QuantizedEmbedding, QuantizedOutputHead, TiedOutputHead
from quantlab.nn.quantized_linear import QuantizedLinear

__all__ = ["QuantizedEmbedding", "QuantizedLinear", "QuantizedOutputHead", "TiedOutputHead"]
