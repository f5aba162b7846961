"""A tiny Llama checkpoint with a byte-level tokenizer, shared by the workflow tests."""

from pathlib import Path

import pytest

from quantlab.testing import byte_tokenizer, tiny_llama_checkpoint
from quantlab.workflows import evaluation_text

# Windows small enough for the tiny Llama (128 positions) and the bundled text.
TINY_TEXT = {"seq_len": 64, "windows": 2}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("models") / "tiny-llama", tokenizer=byte_tokenizer())


@pytest.fixture(scope="module")
def tiny_text():
    return evaluation_text(**TINY_TEXT)
