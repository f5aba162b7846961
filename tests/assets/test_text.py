import os
from pathlib import Path

import pytest

from quantlab.assets.text import bundled_text, bundled_text_path, data_dir, read_text

SHARED = os.environ.get("QUANTLAB_SHARED") or Path(__file__).resolve().parents[3] / "shared"
SHARED_TEXT = Path(SHARED) / "data" / "wikitext-2-raw-test.txt"
needs_shared_text = pytest.mark.skipif(not SHARED_TEXT.is_file(), reason=f"{SHARED_TEXT} is not on this machine")


def test_bundled_text_is_a_large_wikitext_excerpt():
    text = bundled_text()
    assert bundled_text_path().is_file()
    assert text.startswith(" = Robert Boulter = \n")
    assert "\r" not in text
    assert len(text) > 400_000


def test_licence_note_ships_beside_the_text():
    note = (data_dir() / "WIKITEXT-LICENSE.txt").read_text(encoding="utf-8")
    assert "CC BY-SA 3.0" in note
    assert "Merity" in note


@needs_shared_text
def test_bundled_text_is_the_head_of_the_full_file_read_as_text():
    full = read_text(SHARED_TEXT)
    text = bundled_text()
    assert full.startswith(text)
    assert len(text) < 0.4 * len(full)


@pytest.mark.slow
@needs_shared_text
def test_first_harness_windows_equal_those_of_the_full_file():
    from transformers import AutoTokenizer

    from quantlab.assets.models import smollm2_dir
    from quantlab.eval.perplexity import token_ids

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True)
    full = token_ids(tokenizer, read_text(SHARED_TEXT))
    bundled = token_ids(tokenizer, bundled_text())
    assert len(full) == 301_948  # the harness's token count: the file is read with universal newlines
    assert bundled[: 16 * 512] == full[: 16 * 512]
    assert len(bundled) > 100_000
