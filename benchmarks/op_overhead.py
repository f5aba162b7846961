"""Per-call cost of a quantized layer at one row: the torch operator against the ctypes call, side by side.

    python benchmarks/op_overhead.py                     # 576x576, one row, 4-bit g64 / NF4 / int8
    python benchmarks/op_overhead.py --shape 576x192 --rounds 9 --threads 1

At one row on SmolLM2's small layers the work is a few microseconds, so what a call costs
around the kernel decides the speed. Candidates, each timed in every round in rotated order
(a round's figure is the median of its calls, microseconds): torch fp32 `nn.Linear`; each
quantlab layer called as a model calls it (`layer(x)`), once through the `quantlab::linear`
operator and once with the operator switched off (the C library through ctypes, the path
before the operator existed); the bare operator call `torch.ops.quantlab.linear.default(x, *args)`.
"""

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch

import quantlab
from quantlab import CustomBitsConfig, Int8SymmetricConfig, NF4Config
from quantlab.kernels.cpu import ops

CONFIGS = {"4b g64": CustomBitsConfig(bits=4, group_size=64), "nf4": NF4Config(), "int8": Int8SymmetricConfig()}


@contextlib.contextmanager
def without_operator() -> Iterator[None]:
    """Quantized layers call the C library through ctypes, as before the operator existed."""
    available = ops.available
    ops.available = lambda: False
    try:
        yield
    finally:
        ops.available = available


def median_call_us(call: Callable[[], object], calls: int) -> float:
    call()
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="576x576", help="in x out features")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000, help="calls per candidate and round")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    in_features, out_features = map(int, args.shape.split("x"))
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features)
    x = torch.randn(1, in_features)
    if not ops.available():
        raise SystemExit("quantlab's torch operators are unavailable here: nothing to compare")

    candidates: dict[str, Callable[[], object]] = {"torch fp32": lambda: linear(x)}
    for name, config in CONFIGS.items():
        layer = quantlab.get_method(config.method).module_class.from_linear(linear, config)
        arguments = ops.linear_arguments(layer)
        candidates[f"ql {name} op"] = lambda layer=layer: layer(x)
        candidates[f"ql {name} ctypes"] = lambda layer=layer: layer(x)  # timed with the operator off
        candidates[f"ql {name} bare op"] = lambda arguments=arguments: ops.linear_op(x, *arguments)

    results: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    with torch.no_grad():
        for round_index in range(args.rounds):
            for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                switch = without_operator() if name.endswith("ctypes") else contextlib.nullcontext()
                with switch:
                    results[name].append(median_call_us(candidates[name], args.calls))

    print(f"{args.shape}, one row, {torch.get_num_threads()} threads, {args.rounds} rounds x {args.calls} calls")
    print(f"{'candidate':<22} {'us/call (median [min-max] over rounds)':>40}")
    for name, values in results.items():
        print(f"{name:<22} {statistics.median(values):>10.2f} [{min(values):.2f}-{max(values):.2f}]")


if __name__ == "__main__":
    main()
