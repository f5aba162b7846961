"""Write outputs so that they are never half-written, and never destroy what they replace by mistake.

Everything goes to a temporary sibling first and is renamed into place at the end; an
exception (or a full disk) leaves the previous output, if any, untouched. The renamed output
gets the permissions a plain `mkdir` or `open` would give it (`tempfile` makes private ones).

What an output may replace: never a `protect`ed input, a folder holding one, or a path inside an
input folder (`quantize X/model -o X --overwrite` would delete its own input); nothing without
`overwrite`, checked when the block starts and again at the final rename (an output that
appeared meanwhile is not replaced); with `overwrite`, never a folder that holds the current
directory.

Temporary folders are named `.NAME.KIND-PID-HOST-xxxx`: they are removed when the block ends,
including by SIGINT or SIGTERM once the CLI turned that into an exception (`quantlab.cli.main`),
and a folder left by a process that no longer exists (SIGKILL, power loss) is removed by the
next write to the same output; a replaced output caught between its two renames is put back.
"""

import contextlib
import errno
import functools
import hashlib
import os
import re
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from quantlab.errors import QuantlabError

_KINDS = ("tmp", "old", "run", "partial")  # "partial": a resumable result, kept when its process dies


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


class UnsafeOutputError(QuantlabError, ValueError):
    """Replacing the output would delete an input or the current directory."""


# -- what may be replaced -----------------------------------------------------------------------


def check_replaceable(target: str | os.PathLike, overwrite: bool, protect: Iterable[str | os.PathLike] = ()) -> Path:
    """Refuse a `target` that overlaps a `protect`ed input (always), an existing one without `overwrite`,
    and one that holds the current directory."""
    target = Path(target)
    check_not_input(target, protect)
    if not target.exists() and not target.is_symlink():
        return target
    if not overwrite:
        raise OutputExistsError(f"output {target} already exists; pass --overwrite (overwrite=True) or pick another")
    if _contains(target.resolve(), Path.cwd().resolve()):
        raise UnsafeOutputError(
            f"output {target} is or contains the current directory, which --overwrite would delete; "
            f"name a new folder instead"
        )
    return target


def check_not_input(target: str | os.PathLike, inputs: Iterable[str | os.PathLike]) -> None:
    """Refuse a `target` that is, contains or lies inside one of `inputs`, whatever `--overwrite` says.

    Paths are compared resolved, symlinks followed: writing there would replace or change an input.
    """
    resolved = Path(target).resolve()
    for path in inputs:
        source = Path(path).resolve()
        if resolved == source:
            raise UnsafeOutputError(f"output {target} is the input {path}; write somewhere else")
        if _contains(resolved, source):
            raise UnsafeOutputError(
                f"output {target} contains the input {path}, which writing there would replace; write somewhere else"
            )
        if source.is_dir() and _contains(source, resolved):
            raise UnsafeOutputError(f"output {target} lies inside the input folder {path}; write outside it")


def _contains(folder: Path, path: Path) -> bool:
    return path == folder or folder in path.parents


# -- staging folders --------------------------------------------------------------------------


@functools.cache
def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def make_staging(parent: Path, name: str, kind: str = "tmp") -> Path:
    """A new hidden folder beside `parent/name`, tagged with this process so leftovers can be told apart."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}")
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{name}.{kind}-{os.getpid()}-{_host_tag()}-", dir=parent))


@contextlib.contextmanager
def scratch_directory(parent: str | os.PathLike, name: str) -> Iterator[Path]:
    """A temporary folder beside `parent/name`, removed when the block ends (leftovers of dead processes too)."""
    parent = Path(parent)
    remove_leftovers(parent, name)
    folder = make_staging(parent, name, "run")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_leftovers(parent: Path, name: str) -> list[Path]:
    """Remove staging folders of `parent/name` whose process is gone; put back an output caught mid-swap.

    Returns what was removed or restored. Folders of live processes (a concurrent writer) and of
    other hosts (a shared file system) are left alone.
    """
    removable = [kind for kind in _KINDS if kind != "partial"]  # `--resume` may still continue it
    pattern = re.compile(rf"^\.{re.escape(name)}\.({'|'.join(removable)})-(\d+)-([0-9a-f]{{8}})-")
    handled = []
    if not parent.is_dir():
        return handled
    for path in sorted(parent.iterdir()):
        match = pattern.match(path.name)
        if match is None or match.group(3) != _host_tag() or _alive(int(match.group(2))):
            continue
        kept = path / name
        if match.group(1) == "old" and (kept.exists() or kept.is_symlink()) and not (parent / name).exists():
            os.replace(kept, parent / name)  # killed between retiring the old output and renaming the new one
        shutil.rmtree(path, ignore_errors=True)
        handled.append(path)
    return handled


_TAG = re.compile(rf"\.({'|'.join(_KINDS)})-(\d+)-([0-9a-f]{{8}})-[^/]*$")


def is_staging_of_live_process(path: Path) -> bool:
    """Whether `path` is a staging folder of a process still running (on this host, or on another: unknown)."""
    match = _TAG.search(Path(path).name)
    if match is None:
        return False
    return match.group(3) != _host_tag() or _alive(int(match.group(2)))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while an output is swapped, so no signal lands between the two renames."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:  # not on this platform
        yield
        return
    previous = mask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, previous)


# -- atomic outputs ---------------------------------------------------------------------------

# numpy's `tofile` (the GGUF writer's path) reports a short write with no errno: the disk is full.
_SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")


@contextlib.contextmanager
def full_disk_reported(folder: Path) -> Iterator[None]:
    """Re-raise a write that stopped short with no errno (numpy's `tofile`) as the ENOSPC it is, so every
    output format reports a full disk the same way (the CLI: one line, exit 2)."""
    try:
        yield
    except OSError as error:
        if error.errno is not None or not (_SHORT_WRITE.match(str(error)) or _no_space_left(folder)):
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder)) from error


def _no_space_left(folder: Path) -> bool:
    try:
        return shutil.disk_usage(folder).free == 0
    except OSError:
        return False


@contextlib.contextmanager
def atomic_directory(
    target: str | os.PathLike, overwrite: bool = False, protect: Iterable[str | os.PathLike] = ()
) -> Iterator[Path]:
    """Yield a temporary directory that replaces `target` once the block succeeds.

    `protect`: inputs that must survive (`target` may not contain them when it is replaced).
    """
    protect, target = list(protect), Path(target)
    remove_leftovers(target.parent, target.name)
    check_replaceable(target, overwrite, protect)
    if target.name in ("", ".", ".."):
        raise UnsafeOutputError(f"output {target} names no new folder; give a folder name")
    staging = make_staging(target.parent, target.name)
    try:
        with full_disk_reported(target.parent):
            yield staging
        commit_directory(staging, target, overwrite, protect)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def commit_directory(
    staging: Path, target: str | os.PathLike, overwrite: bool = False, protect: Iterable[str | os.PathLike] = ()
) -> None:
    """Rename a complete `staging` folder onto `target`, checking again what it may replace (the end of
    `atomic_directory`, for a staging folder that outlives one process, as a resumable result does)."""
    target = Path(target)
    _publish(staging, 0o777)
    if not overwrite and (target.exists() or target.is_symlink()):
        raise OutputExistsError(_appeared(target))
    check_replaceable(target, overwrite, protect)  # again: it may have changed while the work ran
    _move_into_place(staging, target, overwrite)


def _appeared(target: Path) -> str:
    return (
        f"output {target} appeared while this command ran (another writer?); nothing was replaced: "
        f"pass --overwrite (overwrite=True) or pick another"
    )


def _move_into_place(staging: Path, target: Path, overwrite: bool = True) -> None:
    """Rename `staging` to `target`; an existing `target` is replaced only with `overwrite` (without it, one
    that appeared since the caller's check, another writer's, is kept and this one refused)."""
    if not overwrite or not (target.exists() or target.is_symlink()):
        try:
            os.rename(staging, target)  # fails if a non-empty folder or a file took the name since the check
        except OSError as error:
            if error.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise OutputExistsError(_appeared(target)) from error
            raise
        return
    with _signals_deferred():
        retired = make_staging(target.parent, target.name, "old")
        os.replace(target, retired / target.name)
        os.replace(staging, target)
    shutil.rmtree(retired, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in `target`'s folder that is renamed onto `target` on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(handle)
    staging = Path(name)
    try:
        with full_disk_reported(target.parent):
            yield staging
        _publish(staging, 0o666)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
