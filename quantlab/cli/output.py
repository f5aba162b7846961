"""The checkpoint folder a command writes: its `--output DIR --overwrite` flags, the checks made
before any model is loaded, and the JSON report saved beside the checkpoint.

`quantlab inspect --reference` reads the float model's name back from that report.
"""

import argparse
import json
from pathlib import Path
from typing import Any

from quantlab.errors import QuantlabError

REPORT_FILE = "quantlab_report.json"


def add_output_dir_arguments(parser: argparse.ArgumentParser, help: str = "folder to write the checkpoint to") -> None:
    """`--output/-o DIR` (required) and `--overwrite`; `help` says what goes into DIR."""
    parser.add_argument("--output", "-o", required=True, metavar="DIR", help=help)
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")


def check_output(output: Path, overwrite: bool, *inputs: Path) -> None:
    """Before any work: refuse an existing `output` without `--overwrite`, an `output` that is one of the
    `inputs`, and an `--overwrite` that would delete an input or the current directory.

    `atomic_directory` checks again when it renames the result into place.
    """
    from quantlab.utils.atomic import OutputExistsError, check_replaceable

    for path in inputs:
        if output.resolve() == path.resolve():
            raise QuantlabError(f"--output {output} is one of the input models; write somewhere else")
    if output.exists() and not overwrite:
        raise OutputExistsError(f"output {output} already exists; pass --overwrite to replace it, or pick another")
    check_replaceable(output, overwrite, inputs)


def write_report(output: Path, report: dict[str, Any]) -> None:
    """The command's report as JSON beside the checkpoint it describes."""
    from quantlab.utils.atomic import atomic_file

    with atomic_file(output / REPORT_FILE) as staging:
        staging.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
