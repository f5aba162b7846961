"""Fixtures for the evaluation tests: a byte-level tokenizer that fits the tiny models' 256 ids."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (ids 0..255), no special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=128)


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return byte_tokenizer()
