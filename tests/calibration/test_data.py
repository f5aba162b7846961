"""Calibration windows never overlap the evaluation windows."""

import json

import pytest
import torch

from quantlab.assets.text import bundled_text, bundled_text_path
from quantlab.calibration import EVAL_TOKENS, CalibrationDataError, calibration_windows
from quantlab.calibration.data import windows_from_texts
from quantlab.testing.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def bundled_ids(tokenizer):
    return tokenizer(bundled_text(), return_attention_mask=False)["input_ids"]


def test_default_windows_start_after_the_evaluation_windows(tokenizer, bundled_ids):
    windows = calibration_windows(tokenizer, samples=4, seq_len=64)
    assert windows.shape == (4, 64)
    assert windows.flatten().tolist() == bundled_ids[EVAL_TOKENS : EVAL_TOKENS + 256]


def test_a_file_that_starts_with_the_evaluation_text_skips_it(tokenizer, bundled_ids, tmp_path):
    copy = tmp_path / "wiki.txt"
    copy.write_text(bundled_text() + "\nmore text\n", encoding="utf-8")
    windows = calibration_windows(tokenizer, samples=2, seq_len=32, source=copy)
    assert windows.flatten().tolist() == bundled_ids[EVAL_TOKENS : EVAL_TOKENS + 64]


def test_other_text_is_used_from_its_start(tokenizer, tmp_path):
    path = tmp_path / "own.txt"
    path.write_text("abcdefgh" * 100, encoding="utf-8")
    windows = calibration_windows(tokenizer, samples=2, seq_len=16, source=path)
    expected = tokenizer("abcdefgh" * 100, return_attention_mask=False)["input_ids"][:32]
    assert windows.flatten().tolist() == expected


def test_jsonl_documents_end_in_eos(tokenizer, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["first document", "second one"] * 10), encoding="utf-8")
    windows = calibration_windows(tokenizer, samples=2, seq_len=20, source=path)
    assert tokenizer.eos_token_id in windows.flatten().tolist()


def test_too_little_text_says_how_much_is_needed(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("too short", encoding="utf-8")
    with pytest.raises(CalibrationDataError, match=r"needs 8 x 512 = 4,096 tokens but .* gives 9"):
        calibration_windows(tokenizer, samples=8, seq_len=512, source=path)


def test_missing_file_is_named(tokenizer, tmp_path):
    with pytest.raises(CalibrationDataError, match="does not exist"):
        calibration_windows(tokenizer, samples=1, seq_len=16, source=tmp_path / "nope.txt")


def test_bundled_text_cannot_give_more_than_it_has(tokenizer, bundled_ids):
    samples = (len(bundled_ids) - EVAL_TOKENS) // 1024 + 1
    with pytest.raises(CalibrationDataError, match="the bundled text"):
        calibration_windows(tokenizer, samples=samples, seq_len=1024)


def test_windows_from_texts(tokenizer):
    windows = windows_from_texts(tokenizer, ["hello world"] * 10, samples=3, seq_len=8)
    assert windows.shape == (3, 8) and windows.dtype == torch.long
    with pytest.raises(CalibrationDataError, match="texts give"):
        windows_from_texts(tokenizer, ["hi"], samples=3, seq_len=8)


def test_bundled_text_is_where_the_evaluation_reads(bundled_ids):
    """The evaluation windows are the first EVAL_TOKENS tokens: what calibration skips."""
    assert bundled_text_path().is_file()
    assert len(bundled_ids) > EVAL_TOKENS * 2


def test_an_encoder_calibrates_after_its_evaluation_lines(tokenizer, tmp_path):
    from quantlab.assets.text import text_lines
    from quantlab.calibration.data import ENCODER_EVAL_LINES as EVAL_LINES

    lines = text_lines(bundled_text())
    windows = calibration_windows(tokenizer, samples=2, seq_len=32, encoder=True)
    calibrated = tokenizer.decode(windows.flatten().tolist())
    assert calibrated.strip().startswith(lines[EVAL_LINES][:20])
    assert all(line not in calibrated for line in lines[EVAL_LINES - 3 : EVAL_LINES] if len(line) > 40)
    whole_file = tmp_path / "wiki.txt"  # a text that begins with the bundled one (the full test file does)
    whole_file.write_text(bundled_text() + "\nmore text\n", encoding="utf-8")
    assert torch.equal(calibration_windows(tokenizer, 2, 32, source=whole_file, encoder=True), windows)
    own = tmp_path / "own.txt"
    own.write_text("abcdefgh" * 100, encoding="utf-8")
    own_windows = calibration_windows(tokenizer, 2, 16, source=own, encoder=True)
    assert tokenizer.decode(own_windows[0].tolist()) == "abcdefgh" * 2
