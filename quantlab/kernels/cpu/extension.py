"""Building and loading the torch operator extension (`csrc/torch_ops.cpp`): the native kernels as
`torch.ops.quantlab.linear` / `linear_group` / `dequantize`.

The extension is a small C++ file compiled against the running torch's headers with the flags
`torch.utils.cpp_extension` uses (its include and library paths, C++20, position-independent,
torch's C++ ABI), by one compiler run of about ten seconds: no ninja, no Python headers. It holds
no kernels of its own: it calls the C library that `native.py` loaded, whose entry points it is
handed once (`quantlab_torch_ops_bind`). Like the C library it is built into the private cache
(`$QUANTLAB_CACHE/kernels`, named by a hash of its source, the C header, torch's version and ABI,
the compiler and flags) and verified before every load (`quantlab.kernels.trusted`).

Without a C++ compiler, with `QUANTLAB_TORCH_OPS=0`, or when the C library is unavailable,
`load()` returns None: quantized layers then call the C library through ctypes (under torch.compile
as the Python operator `quantlab_ctypes::linear`, traced.py) or run the reference kernel.
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from quantlab.formats.codec import get_codec, native_codecs
from quantlab.formats.nf4 import NF4
from quantlab.kernels import trusted
from quantlab.kernels.cpu import native
from quantlab.utils.environment import switched_on

logger = logging.getLogger(__name__)

SOURCE = native.SOURCES / "torch_ops.cpp"
HEADER = native.SOURCES / "quantlab_cpu.h"
_FLAGS = ["-O2", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden", "-w"]


def enabled() -> bool:
    return switched_on("QUANTLAB_TORCH_OPS")


def cxx_compiler() -> str | None:
    """The C++ compiler: `$CXX`, else c++, g++ or clang++ on the PATH."""
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _command(cxx: str, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{path}" for path in (*cpp_extension.include_paths(), str(native.SOURCES))]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [cxx, *_FLAGS, abi, *includes, str(SOURCE), *libraries, "-lc10", "-ltorch_cpu", "-o", str(output)]


def library_path(cxx: str) -> Path:
    """Where this source, built with this compiler for this torch, lives in the cache."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), HEADER.read_bytes()):
        digest.update(part + b"\0")
    identity = (native._compiler_identity(cxx), torch.__version__, str(torch.version.git_version), sys.platform)
    for part in (*identity, " ".join(_command(cxx, Path("out")))):
        digest.update(part.encode() + b"\0")
    key = f"quantlab_torch_ops-{digest.hexdigest()[:16]}"
    return native.cache_dir() / key / f"{key}.so"


def build() -> Path:
    """Compile the extension into the private cache (at once if this build exists) and return its path."""
    cxx = cxx_compiler()
    if cxx is None:
        raise native.NativeBuildError("no C++ compiler found (set CXX, or install g++ or clang++)")
    path = library_path(cxx)
    if not path.parent.exists():
        logger.info("building quantlab's torch operators into %s", path.parent)
        trusted.install(functools.partial(_compile, cxx), path.parent, path.name)
    return path


def _compile(cxx: str, output: Path) -> None:
    command = _command(cxx, output)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise native.NativeBuildError(
            f"compiling quantlab's torch operators failed:\n$ {' '.join(command)}\n{result.stderr.strip()}"
        )


def _bind(extension: ctypes.CDLL, kernels: ctypes.CDLL) -> ctypes.CDLL:
    bind = extension.quantlab_torch_ops_bind
    floats = ctypes.POINTER(ctypes.c_float)
    bind.argtypes = [*[ctypes.c_void_p] * 5, floats, floats]
    bind.restype = ctypes.c_int
    levels = (ctypes.c_float * (16 * native.KINDS))(*kind_levels())
    absmax_map = (ctypes.c_float * 256)(*NF4.native_tables()["absmax_map"])
    functions = ("ql_gemm", "ql_gemm_group", "ql_dequantize", "ql_product", "ql_attention")
    entries = (ctypes.cast(getattr(kernels, name), ctypes.c_void_p).value for name in functions)
    version = bind(*entries, levels, absmax_map)
    if version != native.ABI_VERSION:
        raise native.NativeBuildError(f"torch operators built for ABI {version}, quantlab's is {native.ABI_VERSION}")
    return extension


def kind_levels() -> list[float]:
    """The level table of every native kind in kind order, 16 floats each (zeros for kinds without one)."""
    flat = [0.0] * (16 * native.KINDS)
    for name, kind in native_codecs().items():
        table = get_codec(name).native_tables().get("levels")
        if table is not None:
            flat[16 * kind : 16 * kind + 16] = table
    return flat


@functools.cache
def load() -> ctypes.CDLL | None:
    """The loaded, bound extension (its operators registered), or None: then layers use ctypes or the reference."""
    kernels = native.library()
    if kernels is None or not enabled():
        return None
    try:
        return _bind(trusted.load_from_cache(build()), kernels)
    except (native.NativeBuildError, trusted.UntrustedLibraryError, OSError, AttributeError) as error:
        warnings.warn(
            "quantlab's torch operators are unavailable, quantized layers call the native kernels through "
            f"ctypes (slower, and not fused in the compiled decode step): {error}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
