"""Native code only from places no one else can write: the private kernel cache and its checks.

quantlab builds its native libraries (the C kernels, the torch operator extension) on first
use into `$QUANTLAB_CACHE/kernels` and loads them into the process, so whoever can write
there runs code as the user. The cache folder, and every folder quantlab creates on the way
to it, is created 0700 whatever the umask. Each build lands in a folder of its own, renamed
into place complete with a record of the library's SHA-256 (`<name>.sha256`), so concurrent
builds never mix one build's library with another's record.

Before every load the chain is verified on open file descriptors, not on names: the cache
folder, the build folder and the library must be owned by the user and not writable by group
or others, the library a regular file (no symlink), its content must hash to the record (or to
what this process itself built), and the library is then loaded through `/proc/self/fd/N`: the
bytes verified are the bytes loaded even if a name is swapped in between. Someone who cannot
write the private folder can plant nothing in it; a folder or file someone else could write,
or a library whose bytes changed after the build (a copy, an edit, a replaced file), is
refused with one line naming the path and the reason, and quantlab runs the reference kernels.

A library the user names explicitly (`QUANTLAB_CPU_KERNELS=/path/lib.so`) is their choice of
file, but it too must be owned by the user or root and not writable by group or others.
"""

import ctypes
import errno
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

PRIVATE_MODE = 0o700
RECORD_SUFFIX = ".sha256"
_PROC_FD = Path("/proc/self/fd")
_built_in_this_process: dict[str, str] = {}  # library path -> SHA-256 of what this process built
_held_open: list[int] = []  # descriptors of loaded libraries: never reused, so never mistaken by the loader


class UntrustedLibraryError(RuntimeError):
    """A native library, or a folder on its way, could be written by someone else or was altered."""

    def __init__(self, path: Path | str, reason: str, fix: str = "") -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"refusing to load native code from {path}: {reason}" + (f"; {fix}" if fix else ""))


def private_directory(path: Path) -> Path:
    """Create `path` and any missing parent with mode 0700 (umask does not widen it), then verify it."""
    path = Path(path).absolute()
    missing = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, PRIVATE_MODE)  # mode & ~umask: never wider than 0700
        except FileExistsError:
            continue  # another process created it: verified below like any existing folder
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_private(os.fstat(descriptor), path, "folder")
    finally:
        os.close(descriptor)
    return path


def sha256_of(descriptor: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(descriptor, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def install(build: Callable[[Path], None], folder: Path, file_name: str) -> Path:
    """Build a library into `folder/file_name` (a private build folder, renamed into place whole).

    `build(staging_path)` writes the library; it runs in a fresh 0700 folder next to the final
    one. The library is made 0700, its SHA-256 recorded beside it, and the folder renamed into
    place; if another process finished the same build first, its build is kept and ours dropped.
    """
    parent = private_directory(folder.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.build-", dir=parent))  # mkdtemp: mode 0700
    try:
        library = staging / file_name
        build(library)
        os.chmod(library, PRIVATE_MODE)  # the linker honours the umask (0777 under umask 000)
        descriptor = os.open(library, os.O_RDONLY | os.O_CLOEXEC)
        try:
            digest = sha256_of(descriptor)
        finally:
            os.close(descriptor)
        record = os.open(staging / (file_name + RECORD_SUFFIX), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(record, "w") as handle:
            handle.write(digest + "\n")
        try:
            os.rename(staging, folder)
        except OSError:
            if not folder.is_dir():
                raise
            # another process installed this build first: keep theirs (verified when loaded)
        else:
            _built_in_this_process[str(folder / file_name)] = digest
            staging = None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return folder / file_name


def write_private_file(path: Path, data: bytes) -> Path:
    """Write `data` to `path` in a private cache folder: a 0600 file renamed into place whole, its SHA-256
    recorded beside it (`<name>.sha256`), so a reader checks it as `load_from_cache` checks a library."""
    folder = private_directory(Path(path).absolute().parent)
    path = folder / Path(path).name
    digest = hashlib.sha256(data).hexdigest()
    for target, content in ((path, data), (path.with_name(path.name + RECORD_SUFFIX), (digest + "\n").encode())):
        descriptor, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=folder)  # mkstemp: mode 0600
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(content)
            os.replace(staging, target)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
    return path


def read_private_file(path: Path) -> bytes | None:
    """The bytes of a file `write_private_file` wrote, after the same checks as a cached library (the
    folder and the file the user's own and private, the content matching its recorded SHA-256); None when
    it does not exist. A file that fails a check raises UntrustedLibraryError."""
    path = Path(path).absolute()
    opened: list[int] = []
    try:
        try:
            folder_fd = _open(path.parent, os.O_RDONLY | os.O_DIRECTORY, opened)
            _check_private(os.fstat(folder_fd), path.parent, "folder")
            descriptor = _open(path, os.O_RDONLY | os.O_NOFOLLOW, opened, folder_fd)
        except FileNotFoundError:
            return None
        _check_private(os.fstat(descriptor), path, "file")
        expected, actual = _recorded_hash(folder_fd, path), sha256_of(descriptor)
        if actual != expected:
            raise UntrustedLibraryError(path, "its SHA-256 differs from the one recorded when it was written",
                                        f"delete {path}")  # fmt: skip
        return os.pread(descriptor, os.fstat(descriptor).st_size, 0)
    finally:
        for descriptor in opened:
            os.close(descriptor)


def load_from_cache(library: Path, mode: int = os.RTLD_LOCAL) -> ctypes.CDLL:
    """Load `cache/<build>/<file>` after verifying the cache folder, the build folder and the file."""
    library = Path(library).absolute()
    build_folder, cache = library.parent, library.parent.parent
    opened: list[int] = []
    try:
        cache_fd = _open(cache, os.O_RDONLY | os.O_DIRECTORY, opened)
        _check_private(os.fstat(cache_fd), cache, "folder")
        build_fd = _open(build_folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, opened, cache_fd)
        _check_private(os.fstat(build_fd), build_folder, "folder")
        library_fd = _open(library, os.O_RDONLY | os.O_NOFOLLOW, opened, build_fd)
        _check_private(os.fstat(library_fd), library, "file")
        expected = _built_in_this_process.get(str(library)) or _recorded_hash(build_fd, library)
        actual = sha256_of(library_fd)
        if actual != expected:
            raise UntrustedLibraryError(
                library,
                f"its SHA-256 {actual[:16]}... differs from the one recorded when it was built ({expected[:16]}...)",
                f"delete {build_folder} and quantlab rebuilds it",
            )
        return _load_descriptor(library_fd, library, mode, opened)
    finally:
        for descriptor in opened:
            os.close(descriptor)


def load_chosen(library: Path, setting: str, mode: int = os.RTLD_LOCAL) -> ctypes.CDLL:
    """Load a library the user named in `setting`: owned by them or root, not group/world writable."""
    library = Path(library).absolute()
    opened: list[int] = []
    try:
        descriptor = _open(library, os.O_RDONLY, opened)
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise UntrustedLibraryError(library, "it is not a regular file")
        fix = f"make it yours and not writable by others (chmod go-w {library}), or unset {setting}"
        _check_owner(status, library, "file", (os.geteuid(), 0), fix)
        _check_not_writable_by_others(status, library, "file", fix)
        return _load_descriptor(descriptor, library, mode, opened)
    finally:
        for descriptor in opened:
            os.close(descriptor)


def _open(path: Path, flags: int, opened: list[int], dir_fd: int | None = None) -> int:
    """Open `path` (its last part only, relative to `dir_fd`, when given) and keep the descriptor in `opened`."""
    try:
        descriptor = os.open(path.name if dir_fd is not None else path, flags | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise UntrustedLibraryError(path, "it is a symbolic link", f"delete {path.parent} and rebuild") from error
        raise
    opened.append(descriptor)
    return descriptor


def _recorded_hash(build_fd: int, library: Path) -> str:
    record_name = library.name + RECORD_SUFFIX
    opened: list[int] = []
    try:
        try:
            descriptor = _open(library.parent / record_name, os.O_RDONLY | os.O_NOFOLLOW, opened, build_fd)
        except FileNotFoundError:
            raise UntrustedLibraryError(
                library, f"no {record_name} records what was built", f"delete {library.parent} and quantlab rebuilds it"
            ) from None
        _check_private(os.fstat(descriptor), library.parent / record_name, "file")
        return os.pread(descriptor, 256, 0).decode("ascii", "replace").strip()
    finally:
        for descriptor in opened:
            os.close(descriptor)


def _load_descriptor(descriptor: int, path: Path, mode: int, opened: list[int]) -> ctypes.CDLL:
    if not _PROC_FD.is_dir():  # no /proc (macOS): the checks above hold for the name
        return ctypes.CDLL(str(path), mode=mode)
    library = ctypes.CDLL(str(_PROC_FD / str(descriptor)), mode=mode)
    opened.remove(descriptor)
    _held_open.append(descriptor)  # the loader knows it by this name: the number must stay taken
    return library


def _check_private(status: os.stat_result, path: Path, what: str) -> None:
    """Cache folders and files: the user's own, writable by no one else (else delete and rebuild)."""
    fix = f"delete {path if what == 'folder' else path.parent} and quantlab rebuilds it"
    if what == "file" and not stat.S_ISREG(status.st_mode):
        raise UntrustedLibraryError(path, "it is not a regular file", fix)
    _check_owner(status, path, what, (os.geteuid(),), fix)
    _check_not_writable_by_others(status, path, what, fix)


def _check_owner(status: os.stat_result, path: Path, what: str, owners: tuple[int, ...], fix: str) -> None:
    if status.st_uid not in owners:
        allowed = f"you ({os.geteuid()})" + (" or root" if 0 in owners else "")
        raise UntrustedLibraryError(path, f"the {what} is owned by user id {status.st_uid}, not by {allowed}", fix)


def _check_not_writable_by_others(status: os.stat_result, path: Path, what: str, fix: str) -> None:
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(status.st_mode)
        raise UntrustedLibraryError(path, f"the {what} is writable by group or others (mode {mode:04o})", fix)
