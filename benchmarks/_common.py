"""Shared helpers of the benchmarks: the default text, tables, the environment, JSON output."""

import json
import os
import platform
import resource
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from quantlab.assets.text import bundled_text_path
from quantlab.utils.atomic import atomic_file


def shared_text_path() -> Path:
    """The shared evaluation text, the WikiText-2 test split: `$QUANTLAB_SHARED/data/...`, default `../shared`."""
    shared = os.environ.get("QUANTLAB_SHARED") or Path(__file__).resolve().parents[2] / "shared"
    return Path(shared) / "data" / "wikitext-2-raw-test.txt"


def default_text_path() -> Path:
    """The shared text when present, else the bundled excerpt: same first 16 x 512 tokens, same perplexities."""
    shared = shared_text_path()
    return shared if shared.is_file() else bundled_text_path()


@contextmanager
def stopwatch() -> Iterator[dict[str, float]]:
    """`with stopwatch() as t: ...` then `t["seconds"]`."""
    timing = {"seconds": 0.0}
    start = time.perf_counter()
    try:
        yield timing
    finally:
        timing["seconds"] = time.perf_counter() - start


def environment() -> dict[str, Any]:
    packages = ("torch", "transformers", "bitsandbytes", "hqq", "quantlab", "quantlab-hqq")
    versions = {}
    for name in packages:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "packages": versions,
    }


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; numbers are expected pre-formatted as strings, None prints as blank."""
    cells = [[("" if value is None else str(value)) for value in row] for row in rows]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def number(value: float | None, digits: int) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    with atomic_file(path) as staging:
        staging.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def cpu_line(threads: int) -> str:
    """The CPU as every figure should name it: vendor and model, the instruction sets that matter to the
    kernels, and torch's own fp32 matmul rate on `threads` threads (a 1024^3 product, best of 5)."""
    fields: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().split("\n\n")[0].splitlines():  # the first processor
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    model = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        model += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    flags = set(fields.get("flags", "").split())
    sets = [name for name in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if name in flags]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(before)
    rate = 2 * 1024**3 / best / 1e9
    return f"{model}, {' '.join(sets) or 'no AVX2'}, torch fp32 matmul {rate:.0f} GFLOP/s on {threads} threads"


def linear_shape_counts(module: torch.nn.Module) -> dict[tuple[int, int], int]:
    """(inputs, outputs) of each distinct Linear layer inside `module`, and how many it has."""
    counts: dict[tuple[int, int], int] = {}
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            key = (layer.in_features, layer.out_features)
            counts[key] = counts.get(key, 0) + 1
    return counts


def fp32_linear_rate(counts: dict[tuple[int, int], int], tokens: int, repeats: int = 3) -> float:
    """torch's own fp32 rate in FLOP/s on Linear products of these shapes at `tokens` rows (the best of
    `repeats` calls each), each shape weighted by its count (`linear_shape_counts`)."""
    flops = seconds = 0.0
    for (inputs, outputs), count in counts.items():
        x, weight = torch.randn(tokens, inputs), torch.randn(outputs, inputs)
        torch.nn.functional.linear(x, weight)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            best = min(best, time.perf_counter() - started)
        flops += count * 2.0 * tokens * inputs * outputs
        seconds += count * best
    return flops / seconds


def peak_resident_mib() -> float:
    """This process's peak resident memory (VmHWM): unlike `ru_maxrss`, not inherited from the parent
    across fork and exec (the forked child starts with the parent's pages resident)."""
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines() if status.is_file() else ():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_peak_mib(command: list[str], name: str) -> float | None:
    """Run a benchmark's child process whose last printed line is its peak memory in MiB; None (with a
    note) when it fails."""
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        print(f"  peak memory of {name} failed: {result.stderr.strip().splitlines()[-1:]}")
        return None
    return float(lines[-1])
