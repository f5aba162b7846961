"""Write outputs so that they are never half-written.

Everything goes to a temporary sibling first and is renamed into place at the end; an
exception (or a full disk) leaves the previous output, if any, untouched. The renamed output
gets the permissions a plain `mkdir` or `open` would give it (`tempfile` makes private ones).
"""

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from quantlab.errors import QuantlabError


@functools.cache
def _umask() -> int:
    """The process umask, read once (reading it means setting it, which is not thread-safe)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _publish(staging: Path, mode: int) -> None:
    """Give a staged output the permissions `mode` minus the umask, as a plain create would."""
    staging.chmod(mode & ~_umask())


class OutputExistsError(QuantlabError, FileExistsError):
    """The output path exists and overwriting was not asked for."""


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces `target` once the block succeeds."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise OutputExistsError(f"output {target} already exists; pass --overwrite (overwrite=True) or pick another")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield staging
        _publish(staging, 0o777)
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, retired / target.name)
            os.replace(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in `target`'s folder that is renamed onto `target` on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(handle)
    staging = Path(name)
    try:
        yield staging
        _publish(staging, 0o666)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
