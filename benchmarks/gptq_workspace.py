"""GPTQ's working memory for one layer, in `in^2` bytes: what the solver adds above its inputs at a given width.

Each width runs in a child process of its own (a peak is per process): a symmetric positive-definite
float32 Hessian `[in, in]` and a weight `[128, in]` are built in pieces (no second full-size copy), the
process's peak resident set is read, the GPTQ solver runs (4-bit symmetric, groups of 128, min-max grid),
and the growth of the peak is reported as MiB and as bytes per `in^2`. The weight's own copies (`out x in`)
are small beside it at 128 outputs; `quantlab.streaming.memory` states the working set as a formula.

    python benchmarks/gptq_workspace.py --inputs 2048 4096 8192
"""

import argparse
import json
import os
import subprocess
import sys

_CHILD = """
import json, resource, sys, torch
import quantlab
from quantlab.methods.custom_bits import CustomBitsLinear
from quantlab.solvers.gptq import SOLVER

size, piece = int(sys.argv[1]), 256
generator = torch.Generator().manual_seed(0)
hessian = torch.empty(size, size)
for start in range(0, size, piece):
    hessian[start : start + piece] = torch.rand(min(piece, size - start), size, generator=generator) * 0.01
for start in range(0, size, piece):  # symmetric: the lower triangle mirrors the upper
    block = hessian[start : start + piece, start : start + piece]
    block.copy_((block + block.T) / 2)
    hessian[start + piece :, start : start + piece] = hessian[start : start + piece, start + piece :].T
hessian.diagonal().add_(float(size))  # diagonally dominant: positive definite
weight = torch.randn(128, size, generator=generator)
layout = CustomBitsLinear.layout_for(size, 128, quantlab.CustomBitsConfig(bits=4, group_size=128, symmetric=True))


class Stats:
    def __init__(self, hessian):
        self.hessian = hessian

    def channel_weights(self):
        return self.hessian.diagonal().clone()


before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
SOLVER.solve(weight, layout, Stats(hessian), {"grid": "minmax"})
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(json.dumps({"inputs": size, "peak_growth_bytes": grown, "in2_bytes": grown / size**2}))
"""


def measure(size: int) -> dict:
    completed = subprocess.run([sys.executable, "-c", _CHILD, str(size)], capture_output=True, text=True, check=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, nargs="+", default=[2048, 4096], help="layer widths (input features)")
    args = parser.parse_args()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| inputs | solver peak above its inputs | bytes per in^2 |\n| --- | --- | --- |")
    for size in args.inputs:
        row = measure(size)
        print(f"| {size} | {row['peak_growth_bytes'] / 2**20:.0f} MiB | {row['in2_bytes']:.1f} |")


if __name__ == "__main__":
    main()
