"""The folders workflows write: checks made before any model is loaded, and the JSON report beside a result.

`quantlab inspect --reference` reads the float model's name back from a quantized checkpoint's report.
"""

import json
from pathlib import Path
from typing import Any

REPORT_FILE = "quantlab_report.json"


def check_output(output: Path, overwrite: bool, *inputs: Path) -> None:
    """Before any work: refuse an `output` that is, contains or lies inside one of the `inputs` (whatever
    `overwrite` says), an existing `output` without `overwrite`, and one holding the current directory.

    `atomic_directory` checks again when it renames the result into place.
    """
    from quantlab.utils.atomic import check_replaceable

    check_replaceable(output, overwrite, inputs)


def report_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, default=str) + "\n"


def write_report(output: Path, report: dict[str, Any]) -> None:
    """A workflow's report as JSON in `output`, beside what it describes (written atomically)."""
    from quantlab.utils.atomic import atomic_file

    with atomic_file(output / REPORT_FILE) as staging:
        staging.write_text(report_json(report), encoding="utf-8")
