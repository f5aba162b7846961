"""Text quantlab reads: the WikiText-2 excerpt it ships, and text or JSONL files given to it.

`bundled_text()` is the head of the WikiText-2 raw test split (CC BY-SA 3.0, see
`quantlab/data/WIKITEXT-LICENSE.txt`). Its first 16 x 512 SmolLM2 tokens equal those of the
full file, so `perplexity(model, tokenizer, bundled_text())` reproduces the shared harness; the
tokens after them are free for calibration or fine-tuning.
"""

import json
import os
from pathlib import Path

from quantlab.errors import QuantlabError

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


def text_lines(text: str) -> list[str]:
    """The non-empty lines of `text`, stripped: the units an encoder embeds."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_text(path: str | Path) -> str:
    """A text file as the harness reads it: UTF-8, universal newlines (CRLF becomes "\\n")."""
    return Path(path).read_text(encoding="utf-8")


def read_documents(path: str | os.PathLike, text_field: str = "text") -> list[str]:
    """A `.jsonl` file gives one document per line (its `text_field`); any other file is one document."""
    path = Path(path)
    if not path.is_file():
        raise QuantlabError(f"training data {path} does not exist; pass a .txt or .jsonl file")
    if path.suffix != ".jsonl":
        return [path.read_text(encoding="utf-8")]
    documents = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise QuantlabError(f"{path}:{number}: not valid JSON ({error.msg})") from error
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise QuantlabError(f"{path}:{number}: no string field {text_field!r}; pass text_field= its name")
            documents.append(record[text_field])
    if not documents:
        raise QuantlabError(f"{path} holds no documents")
    return documents
