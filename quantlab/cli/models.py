"""The MODEL argument of the commands, and the names the commands import from here.

Finding, checking and loading a model lives in the library (`quantlab.loading`, `quantlab.load`),
writing a quantized checkpoint too (`quantlab.saving`, `quantlab.save_quantized`); this module
keeps the command-line argument and re-exports the library's helpers under their old names, so
every command keeps importing them from one place.
"""

import argparse

from quantlab.loading import (
    DEFAULT_MODEL_NAME,
    TOKENIZER_FILES,
    WEIGHT_SUFFIXES,
    ModelSource,
    float_checkpoint,
    io_errors_as_os_errors,
    is_causal_lm,
    load_model,
    load_tokenizer,
    model_class,
    quantization_method_of,
    read_config,
    resolve_model,
    weight_files,
    weights_size,
)
from quantlab.saving import save_checkpoint

__all__ = [
    "DEFAULT_MODEL_NAME",
    "MODEL_HELP",
    "TOKENIZER_FILES",
    "WEIGHT_SUFFIXES",
    "ModelSource",
    "add_model_argument",
    "float_checkpoint",
    "io_errors_as_os_errors",
    "is_causal_lm",
    "load_model",
    "load_tokenizer",
    "model_class",
    "quantization_method_of",
    "read_config",
    "resolve_model",
    "save_checkpoint",
    "weight_files",
    "weights_size",
]

MODEL_HELP = "a Hugging Face model folder or a .gguf file (default: the embedded SmolLM2-135M-Instruct)"


def add_model_argument(parser: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    """The optional MODEL positional that `resolve_model` reads (absent: the embedded default)."""
    parser.add_argument("model", nargs="?", metavar="MODEL", help=help)
