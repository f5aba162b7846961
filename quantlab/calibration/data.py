"""Calibration windows: token ids that calibrated solvers see, never the evaluation windows.

The default is the WikiText-2 excerpt bundled with quantlab, after the perplexity harness's
windows: its first `EVAL_TOKENS` (16 x 512) tokens are what quantlab evaluates on, so
calibration starts at token `EVAL_TOKENS` and takes consecutive windows from there (128 x 256
tokens cover tokens 8,192 to 40,959 of the SmolLM2 tokenization). Any other text or JSONL
file (`{"text": ...}` per line) can be given; if it begins with the evaluation text (the full
WikiText-2 test file does), the evaluation windows are skipped there too.

An encoder is evaluated on the first `ENCODER_EVAL_LINES` (256) non-empty lines of that text
instead (`quantlab.eval.embeddings`), which reach past token 8,192: its calibration starts after them.
"""

from pathlib import Path
from typing import Any

import torch

from quantlab.assets.text import bundled_text, read_documents, read_text, text_lines
from quantlab.errors import QuantlabError

EVAL_WINDOWS, EVAL_SEQ_LEN = 16, 512
EVAL_TOKENS = EVAL_WINDOWS * EVAL_SEQ_LEN
ENCODER_EVAL_LINES = 256  # an encoder's evaluation: the text's first non-empty lines


class CalibrationDataError(QuantlabError, ValueError):
    """The calibration text cannot give the windows asked for."""


def calibration_windows(
    tokenizer: Any, samples: int, seq_len: int, source: str | Path | None = None, *, encoder: bool = False
) -> torch.Tensor:
    """`[samples, seq_len]` token ids from `source` (default: the bundled text after the evaluation windows;
    for an `encoder`, after its evaluation lines)."""
    if encoder and (source is None or Path(source).suffix != ".jsonl"):
        ids, skip = _ids(tokenizer, after_encoder_evaluation_lines(_text(source))), 0
    else:
        ids = _token_stream(tokenizer, source)
        skip = EVAL_TOKENS if _starts_with_evaluation_text(tokenizer, ids) else 0
    available = len(ids) - skip
    needed = samples * seq_len
    if available < needed:
        where = "the bundled text" if source is None else str(source)
        raise CalibrationDataError(
            f"calibration needs {samples} x {seq_len} = {needed:,} tokens but {where} gives {available:,} "
            f"(after the {skip:,} evaluation tokens); pass a longer --calibration-text or lower "
            f"--calibration-samples / --calibration-seq-len"
        )
    return torch.tensor(ids[skip : skip + needed], dtype=torch.long).view(samples, seq_len)


def windows_from_texts(tokenizer: Any, texts: list[str], samples: int, seq_len: int) -> torch.Tensor:
    """`[samples, seq_len]` token ids from a list of texts (each ends in EOS), cut into windows."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = [token for text in texts for token in _ids(tokenizer, text) + eos]
    if len(ids) < samples * seq_len:
        raise CalibrationDataError(
            f"calibration needs {samples} x {seq_len} = {samples * seq_len:,} tokens but the texts give "
            f"{len(ids):,}; pass more text or lower calibration_samples / calibration_seq_len"
        )
    return torch.tensor(ids[: samples * seq_len], dtype=torch.long).view(samples, seq_len)


def _token_stream(tokenizer: Any, source: str | Path | None) -> list[int]:
    if source is not None and Path(source).suffix == ".jsonl":
        path = _existing(source)
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        stream: list[int] = []
        for document in read_documents(path):
            stream += _ids(tokenizer, document) + eos
        return stream
    return _ids(tokenizer, _text(source))


def _text(source: str | Path | None) -> str:
    """The bundled text, or the UTF-8 text file `source`."""
    if source is None:
        return bundled_text()
    path = _existing(source)
    try:
        return read_text(path)
    except UnicodeDecodeError as error:
        raise CalibrationDataError(f"calibration text {path} is not UTF-8 text: {error.reason}") from error


def _existing(source: str | Path) -> Path:
    path = Path(source)
    if not path.is_file():
        raise CalibrationDataError(f"calibration text {path} does not exist; pass a text or JSONL file")
    return path


def after_encoder_evaluation_lines(text: str) -> str:
    """`text` after the bundled text's first `ENCODER_EVAL_LINES` non-empty lines, when it begins with them."""
    bundled = bundled_text()
    last = text_lines(bundled)[ENCODER_EVAL_LINES - 1]
    evaluated = bundled[: bundled.index(last) + len(last)]
    return text[len(evaluated) :] if text.startswith(evaluated) else text


def _starts_with_evaluation_text(tokenizer: Any, ids: list[int]) -> bool:
    evaluation = _ids(tokenizer, bundled_text())[:EVAL_TOKENS]
    return ids[:EVAL_TOKENS] == evaluation


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, return_attention_mask=False, verbose=False)["input_ids"])
