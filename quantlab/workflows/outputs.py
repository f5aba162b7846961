"""The folders workflows write: checks made before any model is loaded, and the JSON report beside a result.

`quantlab inspect --reference` reads the float model's name back from a quantized checkpoint's report.
"""

import json
from pathlib import Path
from typing import Any

from quantlab.errors import QuantlabError

REPORT_FILE = "quantlab_report.json"


def check_output(output: Path, overwrite: bool, *inputs: Path) -> None:
    """Before any work: refuse an existing `output` without `overwrite`, an `output` that is one of the
    `inputs`, and an `overwrite` that would delete an input or the current directory.

    `atomic_directory` checks again when it renames the result into place.
    """
    from quantlab.utils.atomic import OutputExistsError, check_replaceable

    for path in inputs:
        if output.resolve() == path.resolve():
            raise QuantlabError(f"--output {output} is one of the input models; write somewhere else")
    if output.exists() and not overwrite:
        raise OutputExistsError(f"output {output} already exists; pass --overwrite to replace it, or pick another")
    check_replaceable(output, overwrite, inputs)


def report_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, default=str) + "\n"


def write_report(output: Path, report: dict[str, Any]) -> None:
    """A workflow's report as JSON in `output`, beside what it describes (written atomically)."""
    from quantlab.utils.atomic import atomic_file

    with atomic_file(output / REPORT_FILE) as staging:
        staging.write_text(report_json(report), encoding="utf-8")
