"""What verifying a quantized checkpoint costs when it loads (the target: at most 5 % of the load time).

Quantizes SmolLM2-135M once (NF4 + double quant, or `--method`), saves it, then loads the
saved folder again and again in one process, alternating rounds with quantlab's load checks
(safetensors headers against every layer's layout, then loaded tensors and finite scales:
`quantlab/verification.py`) on and off. Prints each side's min / median / max seconds, the ratio
of medians and of minimums, and the load average.

    python benchmarks/load_verification.py --rounds 10
"""

import argparse
import gc
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from _common import environment, stopwatch
from transformers import AutoModelForCausalLM

import quantlab
import quantlab.verification as verify
from quantlab.assets.models import smollm2_dir


@contextmanager
def checks_disabled():
    """The two load checks replaced by no-ops (what loading would cost without them)."""
    saved = verify.verify_checkpoint_files, verify.verify_loaded_layer
    verify.verify_checkpoint_files = verify.verify_loaded_layer = _skip
    try:
        yield
    finally:
        verify.verify_checkpoint_files, verify.verify_loaded_layer = saved


def _skip(*args: Any, **kwargs: Any) -> None:
    return None


def timed_load(directory: str) -> float:
    with stopwatch() as timing:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    del model
    gc.collect()  # the previous model's memory is freed here, not inside the next timed load
    return timing["seconds"]


def alternate(directory: str, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"verified": [], "unverified": []}
    timed_load(directory)  # warm the page cache and imports
    for round_index in range(rounds):
        order: list[tuple[str, Callable[[], float]]] = [
            ("verified", lambda: timed_load(directory)),
            ("unverified", lambda: _unverified(directory)),
        ]
        for name, run in order if round_index % 2 == 0 else reversed(order):
            times[name].append(run())
    return times


def _unverified(directory: str) -> float:
    with checks_disabled():
        return timed_load(directory)


def direct_cost(directory: str, rounds: int) -> list[float]:
    """Seconds the checks themselves take on the loaded model (both checks, every layer), per round."""
    from quantlab.replacement import quantized_layers

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    layers = quantized_layers(model)
    times = []
    for _ in range(rounds):
        with stopwatch() as timing:
            verify.verify_checkpoint_files(Path(directory), layers)
            for name, layer in layers.items():
                verify.verify_loaded_layer(name, layer, checked_loading=False)
        times.append(timing["seconds"])
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--method", default="nf4", help="quantlab method of the checkpoint (default nf4)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = quantlab.get_method(args.method).config_class()
    with tempfile.TemporaryDirectory(prefix="quantlab-verify-") as directory:
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32, quantization_config=config)
        model.save_pretrained(directory)
        del model
        times = alternate(directory, args.rounds)
        checks = direct_cost(directory, args.rounds)
    print(f"SmolLM2-135M {args.method}, {args.rounds} alternating rounds, {environment()['packages']['torch']=}")
    for name, values in times.items():
        print(
            f"  {name:>10}: min {min(values):.3f} s, median {statistics.median(values):.3f} s, max {max(values):.3f} s"
        )
    verified, unverified = times["verified"], times["unverified"]
    print(
        f"  verification: median {statistics.median(verified) / statistics.median(unverified) - 1:+.1%}, "
        f"min {min(verified) / min(unverified) - 1:+.1%} of the load time (target <= +5 %)"
    )
    print(
        f"  the checks alone: min {min(checks) * 1000:.1f} ms, median {statistics.median(checks) * 1000:.1f} ms = "
        f"{statistics.median(checks) / statistics.median(unverified):.1%} of the median unverified load"
    )
    print(f"  load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
