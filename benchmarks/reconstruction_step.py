"""How close a block-wise reconstruction step (`--solver reconstruct`) runs to the arithmetic of its block.

SmolLM2-135M's first `--blocks` blocks are quantized with `custom_bits` (`--bits`, groups of 64, symmetric)
and the `reconstruct` solver (start: round to nearest, so the run is about the training step), on
`--samples` x 256-token calibration windows from the bundled text after the evaluation windows. Each
training step (`steps` per block, `batch_size` windows a step) is timed; the median step is compared with
its arithmetic: 2 FLOPs per weight and token for the forward product and each of the two backward products
(the inputs' and the weights' gradients), plus attention's products (4 x tokens x seq_len x hidden forward,
twice that backward), at torch's own fp32 rate on the block's Linear shapes at the step's rows, measured in
this process. One step is also run under `torch.profiler`, and its time split by operator: the products
(`aten::mm`, `addmm`, `bmm`, attention) against the rest (the fake quantizers' elementwise work, norms,
activations, optimizer).

    python benchmarks/reconstruction_step.py --blocks 2 --steps 20
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import cpu_line, environment, format_table, fp32_linear_rate, linear_shape_counts, write_json

import quantlab
from quantlab.assets.models import smollm2_dir
from quantlab.calibration import block_training, calibration_windows

PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_scaled_dot_product")


def block_step_flops(block: torch.nn.Module, config, tokens: int, seq_len: int) -> float:
    """FLOPs of one training step through `block`: forward plus both backward products."""
    weights = sum(inputs * outputs * count for (inputs, outputs), count in linear_shape_counts(block).items())
    attention = 4 * tokens * seq_len * config.hidden_size
    return 3 * (2 * weights * tokens) + 3 * attention


class StepClock:
    """Wraps the reconstruction's training: each step's forward and backward (`_step_error`), the passes over
    every window (`_pass`) and each block's whole training (`run`) timed; one step profiled."""

    def __init__(self, profile_step: int) -> None:
        self.seconds: list[float] = []  # forward + backward of each step
        self.passes: list[float] = []
        self.runs: list[float] = []
        self.profile_step = profile_step
        self.profile: list[tuple[str, float]] = []
        self._originals = {name: getattr(block_training._Training, name) for name in ("_step_error", "_pass", "run")}

    def __enter__(self) -> "StepClock":
        clock, originals = self, self._originals

        def step_error(training, windows):
            if len(clock.seconds) != clock.profile_step:
                start = time.perf_counter()
                result = originals["_step_error"](training, windows)
                clock.seconds.append(time.perf_counter() - start)
                return result
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
                start = time.perf_counter()
                result = originals["_step_error"](training, windows)
                clock.seconds.append(time.perf_counter() - start)
            clock.profile = [(e.key, e.self_cpu_time_total / 1e6) for e in profiler.key_averages()]
            return result

        def timed(name, into):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                result = originals[name](*args, **kwargs)
                into.append(time.perf_counter() - start)
                return result

            return wrapper

        block_training._Training._step_error = step_error
        block_training._Training._pass = timed("_pass", self.passes)
        block_training._Training.run = timed("run", self.runs)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(block_training._Training, name, original)

    def other_per_step(self) -> float:
        """Seconds a step spends outside its forward and backward: the optimizer, projections, snapshots."""
        return (sum(self.runs) - sum(self.passes) - sum(self.seconds)) / max(len(self.seconds), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=2, help="SmolLM2 blocks to reconstruct")
    parser.add_argument("--steps", type=int, default=20, help="training steps per block")
    parser.add_argument("--batch-size", type=int, default=4, help="calibration windows a step")
    parser.add_argument("--samples", type=int, default=32, help="calibration windows")
    parser.add_argument("--bits", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("reconstruction-step-results"))
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.model.layers = model.model.layers[: args.blocks]
    model.config.num_hidden_layers = args.blocks
    seq_len = 256
    windows = calibration_windows(tokenizer, args.samples, seq_len)
    config = quantlab.CustomBitsConfig(
        bits=args.bits,
        group_size=64,
        symmetric=True,
        solver="reconstruct",
        solver_options={"start": "rtn", "steps": args.steps, "batch_size": args.batch_size},
        calibration_samples=args.samples,
        calibration_seq_len=seq_len,
    )
    float_block = copy.deepcopy(model.model.layers[0])  # its Linear shapes (quantize replaces the layers)
    with StepClock(profile_step=args.steps // 2) as clock:
        quantlab.quantize(model, config, calibration=windows, progress=False)
    tokens = args.batch_size * seq_len
    flops = block_step_flops(float_block, model.config, tokens, seq_len)
    rate = fp32_linear_rate(linear_shape_counts(float_block), tokens, repeats=5)
    median = statistics.median(clock.seconds[1:])
    arithmetic = flops / rate
    total = sum(seconds for _, seconds in clock.profile)
    products = sum(seconds for name, seconds in clock.profile if name.startswith(PRODUCT_OPS))
    top = sorted(clock.profile, key=lambda item: -item[1])[:12]
    other = clock.other_per_step()
    rows = [
        [
            f"{len(clock.seconds)} steps of {tokens} tokens",
            f"{median:.3f}",
            f"{min(clock.seconds):.3f}-{max(clock.seconds):.3f}",
            f"{other:.3f}",
            f"{arithmetic:.3f}",
            f"{(median + other) / arithmetic:.2f}x",
            f"{rate / 1e9:.0f}",
            f"{products / total:.0%}",
            f"{sum(clock.passes) / max(len(clock.runs), 1):.1f}",
        ],
    ]
    table = format_table(
        [
            "run",
            "median s (forward + backward)",
            "min-max",
            "s outside them a step",
            "arithmetic s",
            "step / arithmetic",
            "fp32 GFLOP/s",
            "products' share",
            "s of whole passes a block",
        ],
        rows,
    )
    profile = format_table(
        ["operator (one profiled step)", "self seconds", "share"],
        [[name, f"{seconds:.4f}", f"{seconds / total:.1%}"] for name, seconds in top],
    )
    text = f"{cpu_line(torch.get_num_threads())}\n\n{table}\n\n{profile}\n"
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "reconstruction_step.md").write_text(text, encoding="utf-8")
    write_json(
        args.output / "reconstruction_step.json",
        {
            "environment": environment(),
            "step_seconds": clock.seconds,
            "pass_seconds": clock.passes,
            "block_training_seconds": clock.runs,
            "step_flops": flops,
            "fp32_flops_per_second": rate,
            "profile": clock.profile,
        },
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
