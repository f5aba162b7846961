"""The evaluation flags of the commands: `--eval`, `--text FILE`, and the window sizes.

The defaults (16 windows of 512 tokens of the bundled WikiText-2 slice) are those of
`quantlab.workflows.text`, `benchmarks/quality.py` and the peer figures in `benchmarks/RESULTS.md`.
"""

import argparse

from quantlab.workflows.text import EvaluationText, evaluation_text

TEXT_HELP = "UTF-8 text to measure perplexity on (default: bundled text)"


def add_text_options(parser: argparse.ArgumentParser, context_alias: bool = False) -> None:
    """`--text`, `--seq-len` (also spelled `--context` with `context_alias`) and `--windows`."""
    parser.add_argument("--text", metavar="FILE", help=TEXT_HELP)
    names = ["--seq-len", "--context"] if context_alias else ["--seq-len"]
    parser.add_argument(
        *names, dest="seq_len", type=int, default=512, metavar="N", help="tokens per window (default: 512)"
    )
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
        parser.add_argument("--text", metavar="FILE", help=TEXT_HELP)


def text_from_args(args: argparse.Namespace, seq_len: int | None = None, windows: int | None = None) -> EvaluationText:
    """The evaluation text named by `--text` (or the bundled one) and its windows.

    `seq_len` and `windows` replace `--seq-len` and `--windows` for commands that name them otherwise.
    """
    seq_len = args.seq_len if seq_len is None else seq_len
    windows = args.windows if windows is None else windows
    return evaluation_text(args.text, seq_len, windows)
