"""Test helpers and the contract every quantization method passes, plugins included.

A plugin's test suite reuses the contract by subclassing it (see `quantlab.testing.contract`).
"""

from quantlab.testing.models import tiny_bert, tiny_llama, tiny_model_dir
from quantlab.testing.similarity import sqnr

__all__ = ["sqnr", "tiny_bert", "tiny_llama", "tiny_model_dir"]
