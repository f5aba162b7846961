"""Test helpers and the contract every quantization method passes, plugins included.

A plugin's test suite reuses the contract by subclassing it (see `quantlab.testing.contract`).
"""

from quantlab.testing.models import tiny_bert, tiny_llama, tiny_llama_checkpoint, tiny_model_dir
from quantlab.testing.similarity import sqnr
from quantlab.testing.tokenizer import byte_tokenizer

__all__ = ["byte_tokenizer", "sqnr", "tiny_bert", "tiny_llama", "tiny_llama_checkpoint", "tiny_model_dir"]
