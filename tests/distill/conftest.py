"""Tiny checkpoints with a byte-level tokenizer (256 tokens, the tiny Llama's vocabulary) for the CLI tests."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from quantlab.testing import tiny_llama


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.eos_token = tokenizer.pad_token = alphabet[0]
    return tokenizer


def tiny_checkpoint(path: Path, seed: int = 0, model=None) -> Path:
    """A tiny Llama saved with the byte tokenizer."""
    (model if model is not None else tiny_llama(seed)).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def make_checkpoint():
    return tiny_checkpoint
