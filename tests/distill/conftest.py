"""Tiny checkpoints with a byte-level tokenizer (256 tokens, the tiny Llama's vocabulary) for the CLI tests."""

import pytest

from quantlab.testing import tiny_llama_checkpoint


@pytest.fixture
def make_checkpoint():
    """`make_checkpoint(path, seed=0, model=None)`: a tiny Llama (or `model`) saved with the byte tokenizer."""
    return tiny_llama_checkpoint
