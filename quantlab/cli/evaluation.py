"""Perplexity as the commands measure it: the shared harness of `quantlab.eval`, on the bundled text.

The defaults (16 windows of 512 tokens of the bundled WikiText-2 slice, fp32 compute) are those
of `benchmarks/quality.py` and the baselines, so the figures the CLI prints compare with them.
"""

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantlab.cli.console import Console
from quantlab.errors import QuantlabError
from quantlab.loading import load_model, load_tokenizer, model_class, read_config


def add_text_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", metavar="FILE", help="UTF-8 text to measure perplexity on (default: bundled text)")
    parser.add_argument("--seq-len", type=int, default=512, metavar="N", help="tokens per window (default: 512)")
    parser.add_argument("--windows", type=int, default=16, metavar="N", help="windows scored (default: 16)")


def add_eval_arguments(parser: argparse.ArgumentParser, help: str, window_flags: bool = True) -> None:
    """`--eval` (perplexity before and after the command's change; `help` says of what) and its text options.

    `window_flags=False`: the command has its own window flags (the training commands'
    `--eval-seq-len` and `--eval-windows`), so only `--text` is added.
    """
    parser.add_argument("--eval", action="store_true", help=help)
    if window_flags:
        add_text_options(parser)
    else:
        parser.add_argument(
            "--text", metavar="FILE", help="UTF-8 text to measure perplexity on (default: bundled text)"
        )


@dataclass(frozen=True)
class TextSpec:
    text: str
    source: str
    seq_len: int
    windows: int

    def describe(self) -> str:
        return f"{self.windows} x {self.seq_len} tokens of {self.source}"


def read_text(args: argparse.Namespace, seq_len: int | None = None, windows: int | None = None) -> TextSpec:
    """The evaluation text named by `--text`, or the WikiText-2 slice bundled with quantlab.

    `seq_len` and `windows` replace `--seq-len` and `--windows` for commands that name them otherwise.
    """
    seq_len = args.seq_len if seq_len is None else seq_len
    windows = args.windows if windows is None else windows
    if seq_len < 2 or windows < 1:
        raise QuantlabError(
            f"evaluation windows need at least 2 tokens and at least 1 window (got {seq_len} and {windows})"
        )
    if args.text is None:
        from quantlab.eval.data import bundled_text

        return TextSpec(bundled_text(), "the bundled WikiText-2 text", seq_len, windows)
    path = Path(args.text).expanduser()
    if not path.is_file():
        raise QuantlabError(f"--text {args.text}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise QuantlabError(f"--text {args.text} is not UTF-8 text ({error.reason} at byte {error.start})") from error
    return TextSpec(text, str(path), seq_len, windows)


def measure_perplexity(model: Any, tokenizer: Any, text: TextSpec, console: Console) -> float:
    """Perplexity of an already loaded causal LM with the shared harness."""
    from quantlab.eval import perplexity

    return perplexity(
        model, tokenizer, text.text, seq_len=text.seq_len, windows=text.windows, progress=console.progress
    )


def checkpoint_perplexity(folder: Path, text: TextSpec, console: Console, tokenizer: Any | None = None) -> float:
    """Load `folder` as a causal LM in float32 (the harness's compute) and measure its perplexity."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(folder)
    if tokenizer is None:
        raise QuantlabError(f"{folder} has no tokenizer, which perplexity needs; save one beside the model")
    cls = model_class(read_config(folder))
    model = load_model(folder, cls, dtype=torch.float32)
    return measure_perplexity(model, tokenizer, text, console)
