"""How long `to_onnx` takes on SmolLM2-135M 4-bit with past key values: quantlab's graph clean-up against
`torch.onnx.export(optimize=True)`'s, side by side in one process, rounds alternated.

    python benchmarks/onnx_export_time.py                 # 2 rounds, 2 threads
    python benchmarks/onnx_export_time.py --rounds 3 --threads 1 --json export-time.json

Both variants run the same export; "torch's clean-up" asks `torch.onnx.export` to optimize (onnxscript's
`optimize_ir` with every default rewrite rule, then its fusions) and skips quantlab's
(`quantlab.export.onnx.graph_optimizer`, the same passes without the `SlicesSplit` rule). The files must
be byte for byte the same; the table gives median [min-max] seconds and the ratio within each round.
"""

import argparse
import contextlib
import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from _common import cpu_line, environment, format_table, write_json
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.assets.models import smollm2_dir
from quantlab.export import to_onnx
from quantlab.export.onnx import graph_optimizer

VARIANTS = ("quantlab's clean-up", "torch's clean-up")


@contextlib.contextmanager
def torch_clean_up() -> Iterator[None]:
    """`to_onnx` with torch.onnx.export's own optimize=True and quantlab's clean-up skipped."""
    export, optimize = torch.onnx.export, graph_optimizer.optimize
    torch.onnx.export = lambda *args, **kwargs: export(*args, **{**kwargs, "optimize": True})
    graph_optimizer.optimize = lambda model: None
    try:
        yield
    finally:
        torch.onnx.export, graph_optimizer.optimize = export, optimize


def timed_export(model: torch.nn.Module, variant: str, path: Path) -> tuple[float, str]:
    context = torch_clean_up() if variant == VARIANTS[1] else contextlib.nullcontext()
    with context:
        start = time.perf_counter()
        to_onnx(model, path, with_past=True)
        seconds = time.perf_counter() - start
    digest = hashlib.sha256()
    for file in sorted(path.parent.iterdir()):
        digest.update(file.name.encode() + file.read_bytes())
    return seconds, digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line(args.threads), f"load {os.getloadavg()[0]:.1f}", flush=True)

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    quantlab.quantize(model, quantlab.CustomBitsConfig(bits=4, group_size=64), progress=False)
    seconds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    digests: dict[str, set[str]] = {variant: set() for variant in VARIANTS}
    loads = [os.getloadavg()[0]]
    for round_index in range(args.rounds):
        order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            with tempfile.TemporaryDirectory() as scratch:
                took, digest = timed_export(model, variant, Path(scratch) / "model.onnx")
            seconds[variant].append(took)
            digests[variant].add(digest)
            loads.append(os.getloadavg()[0])
            print(f"round {round_index + 1}: {variant} {took:.1f} s", flush=True)

    ratios = [theirs / ours for ours, theirs in zip(seconds[VARIANTS[0]], seconds[VARIANTS[1]], strict=True)]
    rows = [
        [variant, f"{statistics.median(times):.1f} [{min(times):.1f}-{max(times):.1f}]"]
        for variant, times in seconds.items()
    ]
    rows.append(["torch's / quantlab's, per round", " ".join(f"{ratio:.2f}x" for ratio in ratios)])
    same = len(digests[VARIANTS[0]] | digests[VARIANTS[1]]) == 1
    print(format_table(["variant", "seconds, median [min-max]"], rows))
    print(f"same files: {same}; load average {min(loads):.1f}-{max(loads):.1f}")
    if args.json:
        payload = {"seconds": seconds, "ratios": ratios, "same_files": same, "loads": loads}
        write_json(args.json, {**payload, "cpu": cpu_line(args.threads), "environment": environment()})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
