"""What a command prints: the report on stdout (a table, or one JSON line), everything else on stderr.

Progress bars show only when a person watches: not with `--quiet` or `--json`, and not when
stderr is a file or a pipe. `--quiet` and `--json` also silence transformers' and bitsandbytes'
logging below errors and libraries' deprecation warnings (warnings about results still show).
"""

import argparse
import json
import logging
import math
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
# Libraries that log warnings of their own on import (bitsandbytes: its optional hub kernels).
QUIETED_LOGGERS = ("bitsandbytes",)


def quiet_import_chatter() -> None:
    """Keep the libraries' import-time warnings off the command's stderr (every command imports them while its
    parser is built): bitsandbytes, on CPUs with AVX-512 BF16, tells how to download an optional kernel from a
    model hub, which a quantlab command neither uses nor may reach; an error stays one line."""
    for name in QUIETED_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bars, notes, library logs or deprecation warnings"
    )


@dataclass(frozen=True)
class Console:
    quiet: bool = False
    json: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Console":
        return cls(quiet=getattr(args, "quiet", False), json=getattr(args, "json", False))

    @property
    def silent(self) -> bool:
        return self.quiet or self.json

    @property
    def progress(self) -> bool:
        return not self.silent and sys.stderr.isatty()

    def configure_libraries(self) -> None:
        """Match transformers' progress bars and logging to this console."""
        from transformers.utils import logging as hf_logging

        if self.progress:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()
        if self.silent:
            hf_logging.set_verbosity_error()  # (bitsandbytes' logging is kept to errors for every command: main)
            for category in (FutureWarning, DeprecationWarning):  # libraries' notes to their developers
                warnings.filterwarnings("ignore", category=category)

    def note(self, message: str) -> None:
        """A line for the person at the terminal (stderr), left out with --quiet or --json."""
        if not self.silent:
            print(message, file=sys.stderr, flush=True)

    def bar(self, items: Iterable[T], description: str, total: int | None = None) -> Iterable[T]:
        if not self.progress:
            return items
        from tqdm.auto import tqdm

        return tqdm(items, desc=description, total=total, leave=False)

    def report(self, text: str, data: dict[str, Any]) -> None:
        """The command's result: `text` for people, or `data` as one JSON line with --json."""
        if self.json:
            print(json.dumps(plain(data), default=str), flush=True)
        else:
            print(text, flush=True)


def plain(value: Any) -> Any:
    """`value` with non-finite floats as strings ("inf", "nan"): strict JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


# -- formatting -----------------------------------------------------------------------------


def key_value_table(title: str, rows: Sequence[tuple[str, str]]) -> str:
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join([title, *(f"  {label:<{width}}  {value}" for label, value in rows)])


def column_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; numbers are right-aligned, text left-aligned."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(header)] + [len(row[i]) for row in cells]) for i, header in enumerate(headers)]
    numeric = [bool(cells) and all(_looks_numeric(row[i]) for row in cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        padded = (v.rjust(w) if right else v.ljust(w) for v, w, right in zip(values, widths, numeric, strict=True))
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(row) for row in cells)])


def _looks_numeric(text: str) -> bool:
    try:
        float(text.replace(",", "").removesuffix("%"))
    except ValueError:
        return text == "-"
    return True


def bits_summary(per_quantized_weight: float | None, per_parameter: float) -> str:
    """Bits per weight of the quantized layers, and of the whole model (weight files / parameters)."""
    overall = f"{per_parameter:.3f} per parameter overall (weight files / parameters)"
    return overall if per_quantized_weight is None else f"{per_quantized_weight:.3f} per quantized weight, {overall}"


def disk_size(size: int) -> str:
    """Size on disk in decimal units (kB, MB, GB), as file managers and benchmarks/RESULTS.md report it."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} bytes"


def mebibytes(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"


def seconds(value: float) -> str:
    return f"{value:.1f} s"
