"""Writing an ONNX model atomically, with its weights in a side file when protobuf cannot hold them.

A protobuf message is limited to 2 GiB, so a model whose initializers exceed
`EXTERNAL_DATA_THRESHOLD` keeps them in `<file>.data` next to `<file>` (onnxruntime finds it by
the relative name stored in the model). Everything is written to a temporary folder beside the
target and renamed into place, the data file first: a failure leaves any previous export
untouched.
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx_ir as ir

from quantlab.utils.atomic import OutputExistsError, full_disk_reported

EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # bytes of initializers; leaves room below protobuf's 2 GiB


def initializer_bytes(model: ir.Model) -> int:
    return sum(value.const_value.nbytes for value in model.graph.initializers.values() if value.const_value is not None)


def data_file(path: Path) -> Path:
    return path.parent / (path.name + ".data")


def check_output(target: str | os.PathLike, overwrite: bool = False) -> Path:
    """`target` as a Path, refused when it is a folder, or exists and `overwrite` is false."""
    target = Path(target)
    if target.is_dir():
        raise OutputExistsError(f"output {target} is a directory; give the path of an .onnx file")
    if target.exists() and not overwrite:
        raise OutputExistsError(f"output {target} already exists; pass --overwrite (overwrite=True) or pick another")
    return target


@contextlib.contextmanager
def staged_output(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path named like `target`; on success it (and its `.data`) replace `target`."""
    target = check_output(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        staged = staging / target.name
        with full_disk_reported(target.parent):
            yield staged
        if data_file(staged).exists():
            os.replace(data_file(staged), data_file(target))
        else:
            data_file(target).unlink(missing_ok=True)  # a stale side file of an earlier export
        os.replace(staged, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_model(model: ir.Model, path: Path) -> None:
    """Write `model` to `path`, its initializers to `path.data` when they exceed the threshold."""
    external = initializer_bytes(model) > EXTERNAL_DATA_THRESHOLD
    ir.save(model, path, external_data=data_file(path).name if external else None)


def stored_bytes(path: str | os.PathLike) -> int:
    """Size of an exported model on disk, side file included."""
    path = Path(path)
    return path.stat().st_size + (data_file(path).stat().st_size if data_file(path).exists() else 0)
