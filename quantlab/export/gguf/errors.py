"""Errors of the GGUF export."""

from quantlab.errors import QuantlabError


class GGUFExportError(QuantlabError, ValueError):
    """A model, tokenizer or tensor cannot be written as GGUF as asked; the message names it and why."""


def require_gguf():
    """The `gguf` package (gguf-py, llama.cpp's Python library), or a GGUFExportError saying how to install it."""
    try:
        import gguf
    except ImportError as error:
        raise GGUFExportError(
            "GGUF export needs the 'gguf' package; pip install 'quantlab[models]' installs it"
        ) from error
    return gguf
