"""Fixtures for the evaluation tests: a byte-level tokenizer that fits the tiny models' 256 ids."""

import pytest
from transformers import PreTrainedTokenizerFast

from quantlab.testing import byte_tokenizer


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (ids 0..255), no special tokens."""
    return byte_tokenizer(eos_and_pad=False, model_max_length=128)
