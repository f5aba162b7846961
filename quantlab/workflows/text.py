"""The text perplexity is measured on, and measuring it with the shared harness of `quantlab.eval`.

The defaults (16 windows of 512 tokens of the bundled WikiText-2 slice, float32 compute) are those
of `benchmarks/quality.py` and the peer figures in `benchmarks/RESULTS.md`, so the figures the
workflows report compare with them.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantlab.errors import QuantlabError

BUNDLED_TEXT_NAME = "the bundled WikiText-2 text"


class EvaluationTextError(QuantlabError, ValueError):
    """An evaluation text that is missing, not UTF-8, or windows that cannot be scored."""


@dataclass(frozen=True)
class EvaluationText:
    """A text and the windows (`windows` x `seq_len` tokens) perplexity is measured on."""

    text: str
    source: str
    seq_len: int = 512
    windows: int = 16

    def describe(self) -> str:
        return f"{self.windows} x {self.seq_len} tokens of {self.source}"


def evaluation_text(path: str | os.PathLike | None = None, seq_len: int = 512, windows: int = 16) -> EvaluationText:
    """The UTF-8 text at `path`, or the WikiText-2 slice bundled with quantlab when `path` is None."""
    if seq_len < 2 or windows < 1:
        raise EvaluationTextError(
            f"evaluation windows need at least 2 tokens and at least 1 window (got {seq_len} and {windows})"
        )
    if path is None:
        from quantlab.assets.text import bundled_text

        return EvaluationText(bundled_text(), BUNDLED_TEXT_NAME, seq_len, windows)
    file = Path(path).expanduser()
    if not file.is_file():
        raise EvaluationTextError(f"--text {path}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise EvaluationTextError(f"--text {path} is not UTF-8 text ({error.reason} at byte {error.start})") from error
    return EvaluationText(text, str(file), seq_len, windows)


def measure_perplexity(model: Any, tokenizer: Any, text: EvaluationText, progress: bool = False) -> float:
    """Perplexity of an already loaded causal LM with the shared harness."""
    from quantlab.eval import perplexity

    return perplexity(model, tokenizer, text.text, seq_len=text.seq_len, windows=text.windows, progress=progress)


def reloaded_perplexity(folder: Path, text: EvaluationText, tokenizer: Any = None, progress: bool = False) -> float:
    """Load the checkpoint in `folder` in float32 (the harness's compute) and measure its perplexity."""
    import torch

    from quantlab.loading import open_model

    with open_model(folder) as opened:
        tokenizer = tokenizer if tokenizer is not None else opened.tokenizer()
        if tokenizer is None:
            raise QuantlabError(f"{folder} has no tokenizer, which perplexity needs; save one beside the model")
        model = opened.load(dtype=torch.float32)
    return measure_perplexity(model, tokenizer, text, progress)
