"""Which product a quantized layer runs at many rows, measured on the machine that runs it.

A product of two or more rows of float activations runs either on quantlab's fused kernels (the codes
decoded in registers, panel by panel; on an AVX-512 CPU its AVX2 kernels are a candidate too) or as the
weight decoded into a float buffer and multiplied by torch's own GEMM (MKL or oneDNN). Which is faster
depends on the CPU more than on quantlab: a vendor's BLAS can run its best code on one vendor's CPUs and
a weaker path on another's, so a ratio measured on one machine says little of the next. So the choice is
measured here, once per machine: for each format the native kernels decode (codec kind and bits), each
shape class (`ql_shape_class`: fewer than 512 outputs, other weights below 2M values, larger ones) and
each row bucket (`ql_row_bucket`: 2-15, 16-63, 64-255, 256+ rows), the products are timed on
representative shapes, rounds alternated, and the one whose worst slowdown over the class's shapes is
smallest (`choose`) is set in the C library (`ql_set_product`), the fused kernel keeping a tie (`TIE`).
Every product computes the reference's decoded weights; only the order of the float sums differs.

A format is measured at its first many-row product in a process when no measurement of it for this build
of the kernels, instruction set, CPU, torch and thread count is cached (a few seconds), and cached as JSON
beside the built kernels, with the library's checks (private folder and file, SHA-256 recorded:
`quantlab.kernels.trusted`). `python -m quantlab.kernels.cpu.build` measures every format ahead of time.

`QUANTLAB_KERNELS` overrides the measurement: `measured` (the default), `fused` (the fused kernels at
every row count), `decoded` (decode and torch's GEMM from two rows on). `python -m
quantlab.kernels.cpu.tune --report` prints what was chosen and the measured times against torch fp32.
"""

import argparse
import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from quantlab.errors import ConfigError
from quantlab.formats.codec import get_codec
from quantlab.formats.layout import StorageLayout
from quantlab.kernels import trusted
from quantlab.kernels.cpu import native

logger = logging.getLogger(__name__)

SETTING = "QUANTLAB_KERNELS"
CHOICES = ("measured", "fused", "decoded")
PRODUCT_NAMES = {
    native.PRODUCT_FUSED: "fused",
    native.PRODUCT_FUSED_AVX2: "fused-avx2",
    native.PRODUCT_DECODED: "decoded",
}
TIE = 0.03  # another product must be this much better to replace the fused one (which needs no float copy)
ROUNDS = 2
MIN_SECONDS = 0.002  # a round's figure is its fastest call over at least this long (and at least 2 calls)


@dataclass(frozen=True)
class Format:
    """A format the native kernels decode, as the tuning table keys it: the codec's kind and its bits."""

    name: str
    codec: str
    bits: int
    group_size: int | None
    options: tuple[tuple[str, object], ...] = ()
    scale_dtype: torch.dtype = torch.float32

    @property
    def kind(self) -> int:
        return get_codec(self.codec).native_kind

    def layout(self, in_features: int, out_features: int) -> StorageLayout:
        return StorageLayout.build(self.codec, self.bits, self.group_size, in_features, out_features,
                                   scale_dtype=self.scale_dtype, **dict(self.options))  # fmt: skip


FORMATS = (
    *(Format(f"affine {bits}-bit", "affine", bits, 64, (("symmetric", False),)) for bits in range(2, 9)),
    Format("int8", "int8", 8, None),
    Format("nf4", "nf4", 4, 64, (("double_quant", True),)),
    Format("iq4_nl", "iq4_nl", 4, 32, scale_dtype=torch.float16),
    *(Format(f"lut {bits}-bit", "lut", bits, 64) for bits in (2, 3, 4)),
)
# (in, out) each shape class is measured on (`ql_shape_class`): narrow outputs (grouped-query k/v projections of
# SmolLM2 and TinyLlama), other layers under 2M weights (SmolLM2), larger ones (a 1B model's)
SHAPES = (((576, 192), (2048, 256)), ((576, 576), (576, 1536), (1536, 576)), ((2048, 2048),))
ROWS = ((8, 32, 128, 512), (8, 32, 128, 512), (8, 32, 128, 256))  # each row bucket's rows (256: seconds, not minutes)


@dataclass(frozen=True)
class Entry:
    """One measured cell: milliseconds per call of each product on each of the class's shapes (`by_shape`:
    product name -> times), of torch fp32 (summed over the shapes), and the product chosen (`choose`)."""

    format: str
    shape_class: int
    row_bucket: int
    rows: int
    by_shape: dict[str, tuple[float, ...]]
    fp32_ms: float
    product: str

    def ms(self, product: str) -> float | None:
        """A product's milliseconds summed over the class's shapes (None: not measured here)."""
        times = self.by_shape.get(product)
        return None if times is None else sum(times)


def choose(by_shape: dict[int, tuple[float, ...]]) -> int:
    """The product whose worst slowdown against the fastest, over the class's shapes, is smallest: a class's
    shapes can prefer different products, and no shape should pay much for another's gain (a sum of times
    would let the largest shape decide). The fused product keeps a tie within TIE."""
    best = [min(times) for times in zip(*by_shape.values(), strict=True)]

    def worst(product: int) -> float:
        return max(t / b for t, b in zip(by_shape[product], best, strict=True))

    chosen = min(by_shape, key=worst)
    return chosen if worst(chosen) < worst(native.PRODUCT_FUSED) - TIE else native.PRODUCT_FUSED


@dataclass(frozen=True)
class Table:
    """What was measured, where: the cached file's content."""

    machine: dict
    entries: tuple[Entry, ...]

    def to_json(self) -> str:
        return json.dumps({"machine": self.machine, "entries": [asdict(entry) for entry in self.entries]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Table":
        data = json.loads(text)
        entries = []
        for entry in data["entries"]:
            by_shape = {name: tuple(times) for name, times in entry.pop("by_shape").items()}
            entries.append(Entry(**entry, by_shape=by_shape))
        return cls(data["machine"], tuple(entries))


# -- the machine -----------------------------------------------------------------------------------


@functools.cache
def cpu_name() -> str:
    """The CPU's model name (and vendor, family, model where Linux tells them)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model", "model name") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break
    if not fields:
        return platform.processor() or platform.machine()
    family = f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    return f"{fields.get('model name', '?')} ({fields.get('vendor_id', '?')}, {family})"


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The instruction-set flags that matter to these kernels (AVX2, AVX-512 parts, VNNI, AMX)."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("flags"):
                present = set(line.partition(":")[2].split())
                return tuple(flag for flag in wanted if flag in present)
    return ()


def machine(lib) -> dict:
    """What a measurement depends on; its hash names the cache file."""
    return {
        "cpu": cpu_name(),
        "flags": list(cpu_flags()),
        "isa": native.ISA_NAMES[lib.ql_isa()],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kernels": native.library_key(),
    }


def cache_path(lib) -> Path:
    described = machine(lib)
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
    return native.cache_dir() / "tuning" / f"products-{described['isa']}-t{described['threads']}-{digest}.json"


# -- measuring -------------------------------------------------------------------------------------


def fastest_ms(call: Callable[[], object], min_calls: int = 2, min_seconds: float = MIN_SECONDS) -> float:
    """Milliseconds of the fastest call (at least `min_calls` calls and `min_seconds`), after one untimed call: on
    a shared machine a call longer than a time slice may be preempted, which a mean or median would count."""
    call()
    best, calls, start = float("inf"), 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - start < min_seconds:
        begin = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - begin)
        calls += 1
    return best * 1e3


def stored_weight(fmt: Format, in_features: int, out_features: int, generator: torch.Generator):
    """(layout, stored tensors) of a seeded random weight of `fmt`, quantized by round-to-nearest."""
    layout = fmt.layout(in_features, out_features)
    codec = get_codec(fmt.codec)
    stored = codec.quantize(layout, torch.randn(out_features, in_features, generator=generator) * 0.02)
    return codec.bind(layout, stored), stored


def _weight(fmt: Format, in_features: int, out_features: int, generator: torch.Generator):
    """A seeded random weight of `fmt` as the native kernels (described) and the torch operator take it."""
    return described_weight(*stored_weight(fmt, in_features, out_features, generator))


def described_weight(layout: StorageLayout, stored: dict[str, torch.Tensor]):
    """(the native description, the torch operator's weight arguments) of stored tensors."""
    from quantlab.kernels.cpu.weights import describe_arguments

    others = [None if name is None else stored[name] for name in layout.native_arguments]
    arguments = (layout.descriptor, stored["weight"], *others)
    return describe_arguments(*arguments), arguments


def _product_call(lib, arguments: tuple, described, x: torch.Tensor) -> Callable[[], object]:
    """A call of the product as users run it: the torch operator when it is built, else the ctypes path."""
    from quantlab.kernels.cpu import linear, ops

    if ops.available():
        return lambda: ops.linear_op(x, None, *arguments)
    return lambda: linear._forward(described, x, lib)


def measure(lib, formats: tuple[Format, ...] = FORMATS, shapes=SHAPES, rows=ROWS, rounds: int = ROUNDS) -> Table:
    """Time every candidate product for each format, shape class and row bucket on this machine (and torch
    fp32 on the same shapes, for the report). A shape's class and a row count's bucket are the C library's.

    Each round passes over every cell of a format once, the products alternated within a cell; a cell's
    figure is its fastest round. The rounds of a cell are a whole pass apart, so a burst of load on a shared
    machine (seconds long) slows one round of a cell, not all of them."""
    generator = torch.Generator().manual_seed(0)
    entries = []
    fp32: dict[tuple[int, int, int], float] = {}
    for fmt in formats:
        cells = []  # (shape class, row bucket, rows, k, n, weight, x)
        for class_shapes, class_rows in zip(shapes, rows, strict=True):
            shape_class = _class_of(lib, class_shapes)
            for k, n in class_shapes:
                weight = _weight(fmt, k, n, generator)
                for count in class_rows:
                    x = torch.randn(count, k, generator=generator)
                    cells.append((shape_class, lib.ql_row_bucket(count), count, k, n, weight, x))
        best: dict[tuple, dict[int, float]] = {}
        for _ in range(rounds):
            for shape_class, bucket, count, k, n, weight, x in cells:
                times = _time_products(lib, fmt, shape_class, bucket, weight, x, 1)
                kept = best.setdefault((shape_class, count, k, n), times)
                for product, ms in times.items():
                    kept[product] = min(kept[product], ms)
                if fmt is formats[0]:  # torch fp32 on the same shapes, in the first format's rounds
                    dense = torch.randn(n, k, generator=generator)
                    ms = fastest_ms(partial(torch.nn.functional.linear, x, dense))
                    fp32[k, n, count] = min(fp32.get((k, n, count), ms), ms)
        for class_shapes, class_rows in zip(shapes, rows, strict=True):
            shape_class = _class_of(lib, class_shapes)
            for count in class_rows:
                by_shape = {product: tuple(round(best[shape_class, count, k, n][product], 4) for k, n in class_shapes)
                            for product in candidates(lib)}  # fmt: skip
                product = choose(by_shape)
                reference = round(sum(fp32[k, n, count] for k, n in class_shapes), 4)
                named = {PRODUCT_NAMES[key]: times for key, times in by_shape.items()}
                entries.append(Entry(fmt.name, shape_class, lib.ql_row_bucket(count), count, named, reference,
                                     PRODUCT_NAMES[product]))  # fmt: skip
    return Table(machine(lib), tuple(entries))


def _class_of(lib, shapes: tuple[tuple[int, int], ...]) -> int:
    classes = {lib.ql_shape_class(n, k) for k, n in shapes}
    if len(classes) != 1:
        raise ValueError(f"the shapes {shapes} fall in different classes {sorted(classes)}")
    return classes.pop()


def candidates(lib) -> tuple[int, ...]:
    """The products timed here: the fused kernels and the decoded weight with torch's GEMM, and on an AVX-512
    CPU the AVX2 kernels too."""
    avx512 = lib.ql_isa() == native.ISA_CODES["avx512"]
    return (native.PRODUCT_FUSED, native.PRODUCT_DECODED, *([native.PRODUCT_FUSED_AVX2] if avx512 else []))


def _time_products(lib, fmt: Format, shape_class: int, bucket: int, weight: tuple, x: torch.Tensor,
                   rounds: int) -> dict[int, float]:  # fmt: skip
    """Milliseconds of each candidate product on one shape: each the fastest of its rounds, rounds alternated."""
    described, arguments = weight
    call = _product_call(lib, arguments, described, x)
    isa = lib.ql_isa()
    best = {product: float("inf") for product in candidates(lib)}
    try:
        for _ in range(rounds):
            for product in best:
                lib.ql_set_product(isa, fmt.kind, fmt.bits, shape_class, bucket, product)
                best[product] = min(best[product], fastest_ms(call))
    finally:
        lib.ql_set_product(isa, fmt.kind, fmt.bits, shape_class, bucket, native.PRODUCT_UNSET)
    return best


# -- the cache -------------------------------------------------------------------------------------


def cached_table(lib) -> Table | None:
    """This machine's cached measurement, or None (a file that fails the checks is refused with a warning)."""
    try:
        data = trusted.read_private_file(cache_path(lib))
    except (trusted.UntrustedLibraryError, OSError) as error:
        logger.warning("%s; measuring again", error)
        return None
    if data is None:
        return None
    try:
        return Table.from_json(data.decode())
    except (ValueError, KeyError, TypeError):
        return None


def _save(lib, table: Table) -> None:
    try:
        trusted.write_private_file(cache_path(lib), table.to_json().encode())
    except (OSError, trusted.UntrustedLibraryError) as error:
        logger.warning("the kernel measurement could not be cached: %s", error)


def measured_table(lib, formats: tuple[Format, ...] = FORMATS, remeasure: bool = False) -> Table:
    """The cached measurement with every format of `formats` in it: those missing measured now, then cached."""
    table = None if remeasure else cached_table(lib)
    known = set() if table is None else {entry.format for entry in table.entries}
    missing = tuple(fmt for fmt in formats if fmt.name not in known)
    if not missing:
        return table
    names = {fmt.name for fmt in missing}
    logger.info("measuring the fastest product of %s on this machine (once, seconds a format)", ", ".join(names))
    new = measure(lib, missing)
    kept = () if table is None else tuple(entry for entry in table.entries if entry.format not in names)
    table = Table(new.machine, kept + new.entries)
    _save(lib, table)
    return table


# -- applying --------------------------------------------------------------------------------------


def setting() -> str:
    """`QUANTLAB_KERNELS`, checked: one of CHOICES."""
    value = os.environ.get(SETTING, "measured").strip().lower() or "measured"
    if value not in CHOICES:
        raise ConfigError(f"{SETTING}={value!r} is not a kernel choice: set it to one of {', '.join(CHOICES)}")
    return value


def apply(lib, table: Table, formats: tuple[Format, ...] = FORMATS) -> None:
    """Set the table's choices for `formats` in the C library, for the instruction set it was measured on."""
    isa = native.ISA_CODES[table.machine["isa"]]
    by_name = {fmt.name: fmt for fmt in formats}
    products = {name: code for code, name in PRODUCT_NAMES.items()}
    for entry in table.entries:
        fmt = by_name.get(entry.format)
        if fmt is not None:
            lib.ql_set_product(isa, fmt.kind, fmt.bits, entry.shape_class, entry.row_bucket, products[entry.product])


def apply_everywhere(lib, product: int) -> None:
    """One product for every format, shape class and row bucket of the instruction set in use."""
    isa = lib.ql_isa()
    for fmt in FORMATS:
        for shape_class, class_rows in enumerate(ROWS):
            for bucket in range(len(class_rows)):
                lib.ql_set_product(isa, fmt.kind, fmt.bits, shape_class, bucket, product)


_FORMAT_OF = {(fmt.kind, fmt.bits): fmt for fmt in FORMATS}  # (kind, bits) -> the format measured for it
_settled: set[tuple[int, int, int]] = set()  # (instruction set, kind, bits) whose products are set
_setting_applied: dict[int, str] = {}  # instruction set -> the QUANTLAB_KERNELS value applied


def reset() -> None:
    """Forget what was set: the next `native.library()` applies QUANTLAB_KERNELS and the cache again (after
    changing either in a running process)."""
    _settled.clear()
    _setting_applied.clear()
    native.products_changed()


def ensure(lib) -> None:
    """When the library is handed out: apply QUANTLAB_KERNELS, and what the cache holds for this machine."""
    isa, chosen = lib.ql_isa(), setting()
    if _setting_applied.get(isa) == chosen:
        return
    _setting_applied[isa] = chosen
    _settled.difference_update({key for key in _settled if key[0] == isa})
    if chosen != "measured":
        apply_everywhere(lib, native.PRODUCT_FUSED if chosen == "fused" else native.PRODUCT_DECODED)
        _settled.update((isa, kind, bits) for kind, bits in _FORMAT_OF)
        return
    table = cached_table(lib)
    if table is not None:
        apply(lib, table)
        _settled.update((isa, f.kind, f.bits) for f in FORMATS if f.name in {e.format for e in table.entries})


def ensure_format(lib, kind: int, bits: int) -> None:
    """Before a product of many rows on a format: measure its products here if nothing has set them yet."""
    isa = lib.ql_isa()
    if (isa, kind, bits) in _settled:
        return
    ensure(lib)  # the instruction set in use may have changed since the library was handed out
    if (isa, kind, bits) in _settled:
        return
    _settled.add((isa, kind, bits))
    fmt = _FORMAT_OF.get((kind, bits))
    if fmt is not None:
        apply(lib, measured_table(lib, (fmt,)), (fmt,))


def settle_all(lib) -> None:
    """Every format's products set now (measured where the setting asks and nothing is cached): before timing."""
    for fmt in FORMATS:
        ensure_format(lib, fmt.kind, fmt.bits)


# -- the report ------------------------------------------------------------------------------------


def fp32_gflops(size: int = 1024) -> float:
    """torch's own fp32 GEMM rate on a size^3 product here (the yardstick every ratio is read against)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = fastest_ms(partial(torch.mm, a, b), 3)
    return 2 * size**3 / (best / 1e3) / 1e9


def report(table: Table) -> str:
    """The table as text: the machine, then a row per format, shape class and rows, with ratios to fp32."""
    m = table.machine
    lines = [
        f"CPU: {m['cpu']}; flags: {' '.join(m['flags']) or 'none'}",
        f"kernels: {m['isa']}, {m['threads']} threads, torch {m['torch']} (fp32 GEMM {fp32_gflops():.0f} GFLOP/s "
        f"at 1024^3 now); AMX tiles for int8 activations: {native.amx_status()}",
        "",
        "| format | shapes (in x out) | rows | fused ms | fused AVX2 ms | decoded + torch GEMM ms | torch fp32 ms "
        "| chosen | fp32 / chosen |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in table.entries:
        shapes = ", ".join(f"{k}x{n}" for k, n in SHAPES[e.shape_class])
        times = [e.ms(name) for name in ("fused", "fused-avx2", "decoded")]
        cells = " | ".join("-" if ms is None else f"{ms:.3f}" for ms in times)
        lines.append(f"| {e.format} | {shapes} | {e.rows} | {cells} | {e.fp32_ms:.3f} | {e.product} "
                     f"| {e.fp32_ms / e.ms(e.product):.2f}x |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="print what was chosen and the measured times")
    parser.add_argument("--measure", action="store_true", help="measure every format again, replacing the cache")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    lib = native.library()
    if lib is None:
        print("quantlab's native kernels are unavailable here: every layer runs the reference kernel", file=sys.stderr)
        return 1
    table = measured_table(lib, FORMATS, remeasure=args.measure)
    print(table.to_json() if args.json else report(table) if args.report else cache_path(lib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
