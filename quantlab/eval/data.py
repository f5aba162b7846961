"""Evaluation and training text shipped with quantlab, so nothing is downloaded.

`bundled_text()` is the head of the WikiText-2 raw test split (about 35 % of it, CC BY-SA 3.0,
see `quantlab/data/WIKITEXT-LICENSE.txt`). Its first 16 x 512 SmolLM2 tokens equal those of the
full file, so `perplexity(model, tokenizer, bundled_text())` reproduces the shared harness; the
remaining ~100k tokens are free for calibration or fine-tuning.
"""

from pathlib import Path

BUNDLED_TEXT = "wikitext-2-raw-test-head.txt"
LICENSE = "WIKITEXT-LICENSE.txt"


def data_dir() -> Path:
    """The `quantlab/data` folder of the installed package."""
    return Path(__file__).resolve().parent.parent / "data"


def bundled_text_path() -> Path:
    """Path of the bundled WikiText-2 excerpt (UTF-8, "\\n" line endings)."""
    return data_dir() / BUNDLED_TEXT


def bundled_text() -> str:
    """The bundled WikiText-2 excerpt as one string."""
    return read_text(bundled_text_path())


def read_text(path: str | Path) -> str:
    """A text file as the harness reads it: UTF-8, universal newlines (CRLF becomes "\\n")."""
    return Path(path).read_text(encoding="utf-8")
