"""Building and loading the native CPU kernels (the C sources in `csrc/`) through ctypes.

The library is plain C (no Python or torch headers), so any C compiler builds it, and it
does not depend on the torch ABI. The sources compile in parallel in a few seconds (the
AVX-512 unit takes longest). It is built once per machine into a private cache folder
(`$QUANTLAB_CACHE/kernels`, default `~/.cache/quantlab`, created 0700), never into the installed
package: a read-only or shared installation keeps working, and the build's name carries a hash
of the source, compiler and flags, so an upgraded quantlab never loads a stale build. Every load
is verified first (`quantlab.kernels.trusted`: owner, permissions, the SHA-256 recorded at build
time); a library that fails is refused with a warning. `python -m quantlab.kernels.cpu.build`
builds it ahead of time (for images and CI); `QUANTLAB_CPU_KERNELS=/path/lib.so` points at a
prebuilt one (owned by the user or root, writable by no one else).

Without a C compiler, or with `QUANTLAB_NATIVE_KERNELS=0`, `library()` returns None and
the layers run on the reference kernel: slower, never wrong.

Threads: when torch runs on libgomp (its Linux wheels do), the kernels run on torch's own
OpenMP team instead of a second pool that would compete with it for the cores (pool.c), and
leave it for the library's own pool for a second whenever a call's join waited for a team thread
that was not running (a machine other busy processes share: a late thread never stalls a call
on the own pool); `QUANTLAB_THREAD_POOL=own` keeps them on the own pool throughout.

AMX: on a CPU with AMX tiles (Intel Sapphire Rapids and later) the many-row products on int8 activations
run on them once Linux granted the process the tile state and a check on this machine found them equal to
the AVX512-VNNI kernel and faster than it (`amx_int8_rows.c`); `QUANTLAB_AMX=0` keeps them off. Where Linux refuses, one
note says so and the VNNI kernel runs.
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

from quantlab.kernels import trusted
from quantlab.utils.environment import switched_on

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")
ABI_VERSION = 15
KINDS = 5  # QL_KINDS: the kinds of `ql_weight` (one per native codec, `Codec.native_kind`)
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}
ISA_CODES = {name: code for code, name in ISA_NAMES.items()}
PRODUCT_UNSET, PRODUCT_FUSED, PRODUCT_DECODED, PRODUCT_FUSED_AVX2 = 0, 1, 2, 3  # QL_PRODUCT_*: a many-row product
# -ffp-contract=off: a*b+c stays two roundings, as torch computes it (decoded weights are bit-exact).
_COMPILE = ["-O3", "-std=c11", "-fPIC", "-pthread", "-fvisibility=hidden", "-ffp-contract=off", "-fno-math-errno"]
_LINK = ["-shared", "-pthread", "-lm"]


class NativeBuildError(RuntimeError):
    """The C compiler is missing or failed; the message holds its output."""


class QuantlabCpuWeight(ctypes.Structure):
    """Mirror of `ql_weight` in csrc/quantlab_cpu.h (same fields, same order)."""

    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("groups", ctypes.c_int64),
        ("group_size", ctypes.c_int64),
        ("group_codes", ctypes.c_int64),
        ("group_bytes", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("kind", ctypes.c_int32),
        ("scale", ctypes.c_void_p),
        ("zero", ctypes.c_void_p),
        ("scale_dtype", ctypes.c_int32),
        ("zero_dtype", ctypes.c_int32),
        ("zero_const", ctypes.c_float),
        ("absmax_offset", ctypes.c_float),
        ("absmax_codes", ctypes.c_void_p),
        ("absmax_scale", ctypes.c_void_p),
        ("absmax_block", ctypes.c_int64),
        ("levels", ctypes.c_float * 16),
        ("absmax_map", ctypes.c_float * 256),
    ]


def cache_dir() -> Path:
    root = os.environ.get("QUANTLAB_CACHE") or Path.home() / ".cache" / "quantlab"
    return Path(root).expanduser() / "kernels"


def compiler() -> str | None:
    """The C compiler to use: `$CC`, else the one Python was built with, else cc/gcc/clang."""
    candidates = [os.environ.get("CC"), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc", "clang"]
    for candidate in candidates:
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _compiler_identity(cc: str) -> str:
    result = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.splitlines()[0] if result.stdout else cc


def sources() -> list[Path]:
    return sorted(SOURCES.glob("*.c"))


def build_key(cc: str) -> str:
    """Hash of the sources, compiler and flags: a new quantlab or compiler never reuses an old build."""
    digest = hashlib.sha256()
    for source in sorted(SOURCES.glob("*.[ch]")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    for part in (_compiler_identity(cc), " ".join(_COMPILE + _LINK), sys.platform):
        digest.update(part.encode() + b"\0")
    return f"libquantlab_cpu-{digest.hexdigest()[:16]}"


def library_path(cc: str) -> Path:
    """Where the build of these sources with this compiler and flags lives in the cache."""
    key = build_key(cc)
    return cache_dir() / key / f"{key}.so"


def build(target: Path | None = None) -> Path:
    """Compile the library and return its path (at once if this build already exists).

    Into the cache (`target` None), the build goes through `quantlab.kernels.trusted.install`:
    a private 0700 folder per build, its SHA-256 recorded, renamed into place whole, so
    processes building at the same time never load a half-written or mixed one. An explicit
    `target` (`python -m quantlab.kernels.cpu.build --output`) is written 0755 and renamed
    into place, for images that ship a prebuilt library.
    """
    cc = compiler()
    if cc is None:
        raise NativeBuildError("no C compiler found (set CC, or install gcc or clang)")
    if target is None:
        path = library_path(cc)
        if not path.parent.exists():
            trusted.install(functools.partial(_compile, cc), path.parent, path.name)
            logger.info("built %s", path)
        return path
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.build-", dir=target.parent) as work:
        staging = Path(work) / target.name
        _compile(cc, staging)
        os.chmod(staging, 0o755)  # readable by the image's users, writable only by its owner
        os.replace(staging, target)
    return target


def _compile(cc: str, library: Path) -> None:
    """Compile every source in its own process, all at once, and link them into `library`."""
    with tempfile.TemporaryDirectory(prefix=".objects-", dir=library.parent) as work:
        objects = [Path(work) / f"{source.stem}.o" for source in sources()]
        _run_all([[cc, *_COMPILE, "-c", str(s), "-o", str(o)] for s, o in zip(sources(), objects, strict=True)])
        _run_all([[cc, *_LINK, *map(str, objects), "-o", str(library)]])


def _run_all(commands: list[list[str]]) -> None:
    running = [(command, subprocess.Popen(command, stderr=subprocess.PIPE, text=True)) for command in commands]
    failures = []
    for command, process in running:
        _, errors = process.communicate()
        if process.returncode != 0:
            failures.append(f"$ {' '.join(command)}\n{errors.strip()}")
    if failures:
        raise NativeBuildError("compiling the quantlab CPU kernels failed:\n" + "\n".join(failures))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    weight = ctypes.POINTER(QuantlabCpuWeight)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    integer = ctypes.c_int
    lib.ql_gemm.argtypes = [weight, ptr, i64, i64, ptr, i64, integer]
    lib.ql_gemm.restype = ctypes.c_int
    lib.ql_gemm_group.argtypes = [weight, i64, ptr, i64, i64, ptr, i64, integer, integer]
    lib.ql_gemm_group.restype = ctypes.c_int
    lib.ql_dequantize.argtypes = [weight, i64, i64, ptr, i64, integer]
    lib.ql_dequantize.restype = ctypes.c_int
    lib.ql_quantize_affine.argtypes = [ptr, i64, i64, i64, i64, integer, integer, integer, ptr, ptr, ptr, integer]
    lib.ql_quantize_affine.restype = ctypes.c_int
    lib.ql_quantize_nf4.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, integer]
    lib.ql_quantize_nf4.restype = ctypes.c_int
    lib.ql_pack.argtypes = [ptr, i64, i64, integer, ptr]
    lib.ql_pack.restype = ctypes.c_int
    lib.ql_count_nonfinite.argtypes = [ptr, i64, integer]
    lib.ql_count_nonfinite.restype = i64
    lib.ql_bucketize.argtypes = [ptr, i64, ptr, i64, ptr]
    lib.ql_bucketize.restype = integer
    lib.ql_offset_to_signed.argtypes = [ptr, i64]
    lib.ql_offset_to_signed.restype = integer
    lib.ql_isa.restype = ctypes.c_int
    lib.ql_product.argtypes = [weight, i64]
    lib.ql_product.restype = integer
    lib.ql_set_product.argtypes = [integer] * 6
    lib.ql_set_product.restype = integer
    lib.ql_shape_class.argtypes = [i64, i64]
    lib.ql_shape_class.restype = integer
    lib.ql_row_bucket.argtypes = [i64]
    lib.ql_row_bucket.restype = integer
    lib.ql_has_int8_activations.restype = ctypes.c_int
    lib.ql_force_isa.argtypes = [integer]
    lib.ql_abi_version.restype = ctypes.c_int
    lib.ql_use_openmp.argtypes = [ptr]
    lib.ql_uses_openmp.restype = integer
    if lib.ql_abi_version() != ABI_VERSION:
        raise NativeBuildError(f"library ABI {lib.ql_abi_version()} does not match quantlab's {ABI_VERSION}")
    lib.ql_set_team_stall_ns.argtypes = [i64, i64]
    lib.ql_pool_calls.argtypes = [integer]
    lib.ql_pool_calls.restype = i64
    lib.ql_set_teams.argtypes = [integer]
    lib.ql_argmax.argtypes = [ptr, i64]
    lib.ql_argmax.restype = i64
    lib.ql_amx_status.restype = integer
    lib.ql_amx_check.restype = integer
    lib.ql_amx_speedup.restype = ctypes.c_double
    lib.ql_set_a8_rows.argtypes = [integer]
    lib.ql_set_a8_rows.restype = integer
    lib.ql_a8_rows_choice.restype = integer
    return lib


AMX_STATUS = {0: "ready", 1: "no AMX on this CPU", 2: "Linux refused the tile permission", 3: "compiler without AMX"}
ROWS_ISA, ROWS_AMX, ROWS_AMX_EMULATED = 0, 1, 2
AMX_TIE = 0.03  # the tiles must be this much faster than the VNNI kernel to take its products


def amx_status() -> str:
    """Whether AMX tiles run here: `ready`, else why not (`no AMX on this CPU`, ...); `no kernels` without them."""
    lib = library()
    return "no kernels" if lib is None else AMX_STATUS[lib.ql_amx_status()]


def _amx_check_in_child(lib: ctypes.CDLL) -> int:
    """`ql_amx_check` run in a child process on the same library, so a fault in the tiles ends the child and not
    this process: 0 equal, 1 different, else the child's exit code (negative: the signal that ended it)."""
    path = _mapped_file(ctypes.cast(lib.ql_amx_check, ctypes.c_void_p).value)
    if path is None:
        return -1
    program = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).ql_amx_check() & 0xff)"
    try:
        child = subprocess.run([sys.executable, "-c", program, path], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return -1
    return child.returncode


def _mapped_file(address: int | None) -> str | None:
    """The file mapped at `address` in this process (the verified library, which was loaded through a descriptor)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                low, high = (int(value, 16) for value in fields[0].split("-"))
                if address is not None and low <= address < high and len(fields) >= 6:
                    return fields[5]
    except OSError:
        pass
    return None


def _use_amx(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Turn the AMX many-row kernel on where the CPU, Linux and a check on this machine allow it."""
    status = lib.ql_amx_status()
    if status == 1 or not switched_on("QUANTLAB_AMX"):
        return lib
    if status != 0:
        logger.warning("quantlab: AMX tiles unused (%s); int8 activations run on AVX512-VNNI", AMX_STATUS[status])
        return lib
    verdict = _amx_check_in_child(lib)
    if verdict != 0:
        why = "their products differ from AVX512-VNNI's" if verdict == 1 else f"their check failed ({verdict})"
        logger.warning("quantlab: AMX tiles unused: %s on this machine", why)
        return lib
    speedup = lib.ql_amx_speedup()
    logger.info("quantlab: AMX tiles %.2fx AVX512-VNNI on a 128-row product", speedup)
    if speedup > 1.0 + AMX_TIE:
        lib.ql_set_a8_rows(ROWS_AMX)
    return lib


def enabled() -> bool:
    return switched_on("QUANTLAB_NATIVE_KERNELS")


def torch_gomp_parallel() -> int | None:
    """Address of `GOMP_parallel` in the libgomp torch runs its ops on, or None if it runs on another."""
    import torch

    if not sys.platform.startswith("linux") or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    with open("/proc/self/maps") as maps:
        loaded = {line.split()[-1] for line in maps if "/libgomp" in line}
    if len(loaded) != 1:  # none, or two runtimes in one process: do not guess which one torch uses
        return None
    try:
        function = ctypes.CDLL(loaded.pop()).GOMP_parallel
    except (OSError, AttributeError):
        return None
    return ctypes.cast(function, ctypes.c_void_p).value


def _choose_threads(lib: ctypes.CDLL) -> ctypes.CDLL:
    own_pool = os.environ.get("QUANTLAB_THREAD_POOL", "torch").lower() == "own"
    lib.ql_use_openmp(None if own_pool else torch_gomp_parallel())
    return lib


def _open_library() -> ctypes.CDLL:
    """The user's chosen library, else the cache's build (built now if missing), each verified first."""
    chosen = os.environ.get("QUANTLAB_CPU_KERNELS")
    if chosen:
        return trusted.load_chosen(Path(chosen), "QUANTLAB_CPU_KERNELS")
    return trusted.load_from_cache(build())


@functools.cache
def _load() -> ctypes.CDLL | None:
    try:
        return _use_amx(_choose_threads(_bind(_open_library())))
    except (NativeBuildError, trusted.UntrustedLibraryError, OSError) as error:
        warnings.warn(
            f"quantlab's native CPU kernels are unavailable, quantized layers use the slower reference kernel: {error}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def library() -> ctypes.CDLL | None:
    """The loaded native library, building it on first use; None when disabled or unbuildable.

    Before it is first handed out (and after `force_isa`), the products it runs at many rows are set
    from this machine's measurement (`quantlab.kernels.cpu.tune`, measured now if none is cached)."""
    if "QUANTLAB_NATIVE_KERNELS" in os.environ and not enabled():
        return None
    lib = _load()
    if _products_pending and lib is not None:
        _set_products(lib)
    return lib


_products_pending = True


def _set_products(lib: ctypes.CDLL) -> None:
    global _products_pending
    _products_pending = False  # first: the measurement's own products call library() again
    from quantlab.kernels.cpu import tune

    tune.ensure(lib)


def products_changed() -> None:
    """Set the products again at the next `library()` (after `QUANTLAB_KERNELS` or the instruction set changed)."""
    global _products_pending
    _products_pending = True


@functools.cache
def library_key() -> str:
    """What names the library in use: its build's key, or the path of the one `QUANTLAB_CPU_KERNELS` names."""
    chosen = os.environ.get("QUANTLAB_CPU_KERNELS")
    if chosen:
        return f"chosen {Path(chosen).absolute()} {Path(chosen).stat().st_mtime_ns}"
    cc = compiler()
    return build_key(cc) if cc else "unbuilt"


def thread_pool() -> str | None:
    """Whose threads the kernels run on: `torch` (its OpenMP team), `own` (the library's pool), or None."""
    lib = library()
    return None if lib is None else ("torch" if lib.ql_uses_openmp() else "own")


def isa() -> str | None:
    """Instruction set the kernels run with on this CPU (`avx512`, `avx2`, `scalar`), or None."""
    lib = library()
    return None if lib is None else ISA_NAMES[lib.ql_isa()]


def force_isa(name: str) -> None:
    """Run the kernels on instruction set `name` (`avx512`, `avx2`, `scalar`; `native`: the best this CPU
    has), or on the best one below it this CPU has: to measure and test a lower path on a newer CPU."""
    codes = ISA_CODES | {"native": -1}
    if name not in codes:
        raise ValueError(f"unknown instruction set {name!r}: choose one of {', '.join(sorted(codes))}")
    lib = library()
    if lib is not None:
        lib.ql_force_isa(codes[name])
        products_changed()


def int8_activations_supported() -> bool:
    """Whether this CPU runs an int8-activation kernel (AVX2, or AVX-512 with VNNI) that
    `compile_for_decoding(int8_activations=True)` asks for; elsewhere those layers compute in float."""
    lib = library()
    return lib is not None and bool(lib.ql_has_int8_activations())
