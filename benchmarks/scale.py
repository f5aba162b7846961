"""How quantizing and quantization-aware training scale with the model: wall time and peak resident memory
of `quantlab quantize` on Llama-shaped models from 135M to ~2.7B parameters, for round to nearest and GPTQ,
and of `quantlab qat` on them (`--methods qat-grids,qat-weights`).

Each shape is built from a config with seeded random weights (N(0, 0.02); norms 1) and written as
sharded safetensors into a scratch folder, one shard in memory at a time, with a byte-level
tokenizer (ids below 256, so any vocabulary serves and the calibration text is the bundled one).
Each run is `python -m quantlab quantize` (4-bit g64 `custom_bits`; GPTQ on 32 x 256 calibration
windows) in a child process, measured from outside: wall time around the child, peak resident
memory from `/usr/bin/time -v` (else polling `/proc` of the child's process tree). The predicted
peak is read from the checkpoint's `quantlab_report.json` when quantlab reports one.

QAT runs (`qat-grids`: scales and zero points trained, codes frozen; `qat-weights`: every weight through a
fake quantizer) start from the round-to-nearest checkpoint (made first, not timed) and train `--qat-steps`
steps of `--qat-batch` x `--seq-len` tokens against the float checkpoint (teacher weights in `--teacher-weights`).
Their "predicted" peak is the run report's (`quantlab.qat.memory`); their time column is seconds per step (the
report's median of the steps after the first) against the step's arithmetic: 2 FLOPs per weight and token for
the teacher's forward, the student's forward and each of the student's two backward products (input and
weight gradients; attention's products included), at torch's own fp32 rate on the model's Linear shapes at
the step's rows, measured in this process.

Derived columns: seconds per 1e9 parameters; for RTN, that figure's growth over the next smaller
shape run; for GPTQ, the time its arithmetic predicts from the next smaller shape run, scaling the
smaller run's time by the ratio of `sum over block layers of d_in^2 * d_out + d_in^3` (the solve
and the Hessian inverse), and the measured time over that prediction. Peaks at 24 and 12 blocks of
one width are compared as well. Writes `scale.json`, `scale.md` and `scale.png` (peak memory and
time against parameters; needs matplotlib: `pip install quantlab[bench]`) into `--output`.

    python benchmarks/scale.py --shapes h1024x12,h1024x24 --output scale-results
    python benchmarks/scale.py --output scale-results            # every shape but the 70B-wide one (hours)
    python benchmarks/scale.py --shapes tinyllama --methods gptq --scratch /big/disk --keep
    python benchmarks/scale.py --shapes smollm2-135m,tinyllama --methods qat-grids --teacher-weights bfloat16
    python benchmarks/scale.py --shapes llama70b-2blocks --methods gptq --dtype bfloat16 --samples 128
    python benchmarks/scale.py --shapes qwen3moe-1b --methods gptq     # a ~1B mixture of 16 experts
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import environment, format_table, fp32_linear_rate, linear_shape_counts, write_json
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from quantlab.nn.kinds import fused_experts_shape, is_fused_experts
from quantlab.testing import byte_tokenizer

GIB = 1024**3
SHARD_BYTES = 1 * GIB
TIME = "/usr/bin/time"


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    blocks: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    methods: tuple[str, ...] = ("rtn", "gptq")  # what runs by default
    in_default_run: bool = True  # False: only when named in --shapes
    experts: int = 0  # a Qwen3-MoE shape: this many experts in every block's MLP (`intermediate` each)
    experts_per_token: int = 2

    def config(self, dtype: torch.dtype) -> Any:
        shared = {
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.blocks,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied,
            "max_position_embeddings": 2048,
            "bos_token_id": 0,
            "eos_token_id": 0,
        }
        if self.experts:
            # the routed weights renormalized, as Qwen3-30B-A3B sets it (and llama.cpp's qwen3moe graph computes)
            mixture = {"num_experts": self.experts, "num_experts_per_tok": self.experts_per_token}
            mixture.update(moe_intermediate_size=self.intermediate, head_dim=self.hidden // self.heads)
            mixture.update(norm_topk_prob=True)
            config = Qwen3MoeConfig(**shared, **mixture)
        else:
            config = LlamaConfig(**shared)
        config.architectures = [self.model_class.__name__]
        config.dtype = dtype
        return config

    @property
    def model_class(self) -> type:
        return Qwen3MoeForCausalLM if self.experts else LlamaForCausalLM


SHAPES = {
    shape.name: shape
    for shape in (
        Shape("smollm2-135m", 576, 30, 1536, 9, 3, 49152, tied=True),
        Shape("h1024x12", 1024, 12, 4864, 16, 4, 32000),
        Shape("h1024x24", 1024, 24, 4864, 16, 4, 32000),  # ~0.5B
        Shape("tinyllama", 2048, 22, 5632, 32, 4, 32000),  # TinyLlama-1.1B's shape
        Shape("h2560x36", 2560, 36, 6912, 32, 8, 32000, methods=("rtn",)),  # ~2.7B
        # Two blocks of Llama-2/3-70B's widths: GPTQ's statistics and working set at 28,672 inputs.
        Shape("llama70b-2blocks", 8192, 2, 28672, 64, 8, 32000, methods=("gptq",), in_default_run=False),
        # A Qwen3-MoE shape of ~1B parameters: 16 experts of 768 in every block, 2 per token.
        Shape("qwen3moe-1b", 1024, 24, 768, 16, 4, 32000, experts=16, in_default_run=False),
    )
}


@dataclass
class Run:
    shape: str
    method: str
    parameters: int
    bytes_fp32: int
    gptq_work: float  # sum over block layers of d_in^2 * d_out + d_in^3
    wall_seconds: list[float] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)
    predicted_peak_bytes: int | None = None
    load_average: list[float] = field(default_factory=list)  # 1-minute load average after each round
    step_seconds: list[float] = field(default_factory=list)  # QAT: training seconds per step
    step_flops: float = 0.0  # QAT: the arithmetic of one step
    fp32_flops_per_second: float = 0.0  # torch's own fp32 matrix product on this machine

    @property
    def wall(self) -> float:
        return statistics.median(self.wall_seconds)

    @property
    def peak(self) -> float:
        return statistics.median(self.peak_bytes)

    @property
    def seconds_per_billion(self) -> float:
        return self.wall / (self.parameters / 1e9)


def write_checkpoint(shape: Shape, folder: Path, dtype: torch.dtype, seed: int) -> None:
    """`shape` as a sharded safetensors checkpoint in `folder` (random weights, one shard in memory at a time)."""
    config = shape.config(dtype)
    with torch.device("meta"):
        model = shape.model_class(config)
        # the names and shapes `save_pretrained` writes (a mixture's experts one by one, as transformers stores them)
        names = {name: tuple(t.shape) for name, t in revert_weight_conversion(model, model.state_dict()).items()}
    if shape.tied:
        names.pop("lm_head.weight", None)
    shards: list[list[str]] = [[]]
    size = 0
    for name, dims in names.items():
        nbytes = math.prod(dims) * dtype.itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _random_tensor(name, names[name], dtype, seed) for name in shard}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(shard, file))
        del tensors
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2), encoding="utf-8")
    config.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


def _random_tensor(name: str, dims: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(dims, dtype=dtype)
    generator = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    return (torch.randn(dims, generator=generator) * 0.02).to(dtype)


def _meta_model(shape: Shape) -> Any:
    """`shape` on the meta device: its modules' shapes, no memory."""
    with torch.device("meta"):
        return shape.model_class(shape.config(torch.float32))


def model_figures(shape: Shape) -> tuple[int, float]:
    """Parameters, and GPTQ's arithmetic over the Linear layers of the blocks (each expert's slices counted)."""
    model = _meta_model(shape)
    parameters = sum(p.numel() for p in model.parameters())
    shapes = [(m.in_features, m.out_features) for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    for module in model.model.layers.modules():
        if is_fused_experts(module):
            experts, hidden, intermediate = fused_experts_shape(module)
            shapes += [(hidden, 2 * intermediate), (intermediate, hidden)] * experts
    work = sum(float(inputs) ** 2 * outputs + float(inputs) ** 3 for inputs, outputs in shapes)
    return parameters, work


def quantize_command(checkpoint: Path, output: Path, method: str, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "quantlab", "quantize", str(checkpoint), "-o", str(output), "--overwrite"]
    command += ["--method", "custom_bits", "--bits", str(args.bits), "--group-size", str(args.group_size)]
    command += ["--solver", method, "--quiet", "--json"]
    if method == "gptq":
        command += ["--calibration-samples", str(args.samples), "--calibration-seq-len", str(args.seq_len)]
    return command


QAT_METHODS = {"qat-grids": "grids", "qat-weights": "weights"}


def qat_command(quantized: Path, teacher: Path, output: Path, method: str, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "quantlab", "qat", str(quantized), "--teacher", str(teacher), "-o", str(output)]
    command += ["--overwrite", "--train", QAT_METHODS[method], "--teacher-weights", args.teacher_weights]
    command += ["--max-steps", str(args.qat_steps), "--batch-size", str(args.qat_batch)]
    command += ["--max-seq-length", str(args.seq_len), "--learning-rate", "1e-3", "--quiet", "--json"]
    if args.activation_checkpointing:
        command += ["--activation-checkpointing"]
    return command


def qat_step_flops(shape: Shape, batch: int, seq_len: int, recomputed: int = 0) -> float:
    """Teacher forward, student forward, student input and weight gradients: 4 x 2 FLOPs per weight and token
    on every Linear (the output head included), and attention's two products in each of the four; with
    activation checkpointing (`recomputed` = 1) the student's forward once more."""
    model = _meta_model(shape)
    linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    tokens = batch * seq_len
    attention = shape.blocks * 2 * 2 * tokens * seq_len * shape.hidden
    return (4.0 + recomputed) * (2 * linear * tokens + attention)


def fp32_rate(shape: Shape, tokens: int, repeats: int = 3) -> float:
    """torch's own fp32 rate in FLOP/s on the step's products: each distinct Linear shape of the model at
    `tokens` rows, weighted by how often the model has it."""
    return fp32_linear_rate(linear_shape_counts(_meta_model(shape)), tokens, repeats)


def measure(command: list[str], log: Path) -> tuple[float, int]:
    """Wall seconds and peak resident bytes of `command`, measured from outside the process."""
    environment_ = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("w", encoding="utf-8") as output:
        if Path(TIME).is_file():
            usage = log.with_suffix(".time")
            started = time.perf_counter()
            process = subprocess.run(
                [TIME, "-v", "-o", str(usage), *command], stdout=output, stderr=output, env=environment_
            )
            wall = time.perf_counter() - started
            _check(process.returncode, log)
            return wall, _time_peak(usage.read_text(encoding="utf-8"))
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=output, stderr=output, env=environment_)
        peak = _poll_peak(process)
        wall = time.perf_counter() - started
        _check(process.returncode, log)
        return wall, peak


def _check(returncode: int, log: Path) -> None:
    if returncode != 0:
        tail = "\n".join(log.read_text(encoding="utf-8").splitlines()[-15:])
        raise SystemExit(f"the run failed (exit {returncode}); the end of {log}:\n{tail}")


def _time_peak(report: str) -> int:
    for line in report.splitlines():
        if "Maximum resident set size (kbytes)" in line:
            return int(line.rsplit(":", 1)[1]) * 1024
    raise SystemExit(f"{TIME} -v reported no maximum resident set size")


def _poll_peak(process: subprocess.Popen) -> int:
    """Peak resident bytes of the process tree: the largest sum of VmRSS seen, or of one process's VmHWM."""
    peak = 0
    while process.poll() is None:
        pids = _tree(process.pid)
        rss = sum(_status_kib(pid, "VmRSS") for pid in pids)
        hwm = max((_status_kib(pid, "VmHWM") for pid in pids), default=0)
        peak = max(peak, rss * 1024, hwm * 1024)
        time.sleep(0.05)
    return peak


def _tree(pid: int) -> list[int]:
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        pending += map(int, children)
    return found


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def predicted_peak(output: Path) -> int | None:
    report = output / "quantlab_report.json"
    if not report.is_file():
        return None
    value = json.loads(report.read_text(encoding="utf-8")).get("predicted_peak_memory_bytes")
    return int(value) if value is not None else None


def table(runs: list[Run]) -> str:
    columns = [
        "shape", "parameters", "fp32 GB", "method", "wall s", "peak GiB", "predicted GiB", "s per 1e9 params",
        "vs smaller", "load avg",
    ]  # fmt: skip
    rows = []
    for run in runs:
        rows.append(
            [
                run.shape,
                f"{run.parameters / 1e9:.3f}B",
                f"{run.bytes_fp32 / 1e9:.2f}",
                run.method,
                _spread(run.wall_seconds, 1),
                _spread([b / GIB for b in run.peak_bytes], 2),
                "n/a" if run.predicted_peak_bytes is None else f"{run.predicted_peak_bytes / GIB:.2f}",
                f"{run.seconds_per_billion:.1f}",
                _versus_smaller(run, runs),
                " ".join(f"{value:.1f}" for value in run.load_average),
            ]
        )
    return format_table(columns, rows)


def _spread(values: list[float], digits: int) -> str:
    median = f"{statistics.median(values):.{digits}f}"
    return median if len(values) == 1 else f"{median} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def _smaller(run: Run, runs: list[Run]) -> Run | None:
    """The largest run of the same method on fewer parameters."""
    candidates = [r for r in runs if r.method == run.method and r.parameters < run.parameters]
    return max(candidates, key=lambda r: r.parameters, default=None)


def _versus_smaller(run: Run, runs: list[Run]) -> str:
    if run.step_seconds:
        predicted = run.step_flops / run.fp32_flops_per_second
        step = statistics.median(run.step_seconds)
        return f"{step:.1f} s a step, {step / predicted:.2f}x its arithmetic ({predicted:.1f} s)"
    smaller = _smaller(run, runs)
    if smaller is None:
        return ""
    if run.method == "gptq":
        predicted = smaller.wall * run.gptq_work / smaller.gptq_work
        return f"predicted {predicted:.0f} s from {smaller.shape}: {run.wall / predicted:.2f}x"
    return f"{run.seconds_per_billion / smaller.seconds_per_billion:.2f}x the s/param of {smaller.shape}"


def depth_checks(runs: list[Run]) -> list[str]:
    """Peak at 24 blocks against peak at 12 blocks of the same width, per method."""
    lines = []
    by_key = {(SHAPES[r.shape].hidden, SHAPES[r.shape].blocks, r.method): r for r in runs}
    for (hidden, blocks, method), deep in by_key.items():
        shallow = by_key.get((hidden, blocks // 2, method))
        if blocks % 2 == 0 and shallow is not None:
            change = 100 * (deep.peak / shallow.peak - 1)
            lines.append(
                f"{method}: peak at {blocks} blocks of width {hidden} is {change:+.1f} % of the peak at {blocks // 2}"
            )
    return lines


def plot(runs: list[Run], path: Path) -> bool:
    """Peak memory and wall time against parameters, one line per method; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (memory, seconds) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in sorted({run.method for run in runs}):
        mine = sorted((r for r in runs if r.method == method), key=lambda r: r.parameters)
        billions = [r.parameters / 1e9 for r in mine]
        memory.plot(billions, [r.peak / GIB for r in mine], marker="o", label=f"{method} measured")
        predicted = [r for r in mine if r.predicted_peak_bytes is not None]
        if predicted:
            memory.plot(
                [r.parameters / 1e9 for r in predicted],
                [r.predicted_peak_bytes / GIB for r in predicted],
                linestyle="--",
                marker="x",
                label=f"{method} predicted",
            )
        seconds.plot(billions, [r.wall for r in mine], marker="o", label=method)
    for axes, label in ((memory, "peak resident memory (GiB)"), (seconds, "wall time (s)")):
        axes.set_xlabel("parameters (billions)")
        axes.set_ylabel(label)
        axes.set_xlim(left=0)
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
        axes.legend()
    figure.suptitle("quantlab quantize, 4-bit: memory and time against model size")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    output = args.output.resolve()
    output.mkdir(parents=True, exist_ok=True)
    if args.scratch is not None:
        args.scratch.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="scale-", dir=args.scratch or output))
    runs: list[Run] = []
    dtype = getattr(torch, args.dtype)
    try:
        for shape in sorted((SHAPES[name] for name in args.shapes), key=lambda s: model_figures(s)[0]):
            methods = [m for m in args.methods if m in shape.methods or m in QAT_METHODS or args.all_methods]
            if not methods:
                continue
            checkpoint = scratch / shape.name
            print(f"writing {shape.name} ({args.dtype}) to {checkpoint}", file=sys.stderr, flush=True)
            write_checkpoint(shape, checkpoint, dtype, args.seed)
            parameters, work = model_figures(shape)
            for method in methods:
                run = Run(shape.name, method, parameters, parameters * 4, work)
                if method in QAT_METHODS:
                    run.step_flops = qat_step_flops(
                        shape, args.qat_batch, args.seq_len, int(args.activation_checkpointing)
                    )
                    run.fp32_flops_per_second = fp32_rate(shape, args.qat_batch * args.seq_len)
                    start = scratch / f"{shape.name}-rtn-start"
                    if not (start / "config.json").is_file():
                        measure(quantize_command(checkpoint, start, "rtn", args), output / f"{shape.name}-start.log")
                for round_ in range(args.rounds):
                    quantized = scratch / f"{shape.name}-{method}"
                    print(f"{shape.name} {method} round {round_ + 1}", file=sys.stderr, flush=True)
                    if method in QAT_METHODS:
                        command = qat_command(scratch / f"{shape.name}-rtn-start", checkpoint, quantized, method, args)
                    else:
                        command = quantize_command(checkpoint, quantized, method, args)
                    log = output / f"{shape.name}-{method}-{round_ + 1}.log"
                    wall, peak = measure(command, log)
                    run.wall_seconds.append(wall)
                    run.peak_bytes.append(peak)
                    run.load_average.append(os.getloadavg()[0])
                    run.predicted_peak_bytes = predicted_peak(quantized)
                    if method in QAT_METHODS:
                        report = json.loads((quantized / "quantlab_report.json").read_text(encoding="utf-8"))
                        run.step_seconds.append(report["step_seconds_median"])
                    shutil.rmtree(quantized, ignore_errors=True)
                runs.append(run)
                _write(runs, output)
            shutil.rmtree(scratch / f"{shape.name}-rtn-start", ignore_errors=True)
            if not args.keep:
                shutil.rmtree(checkpoint, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print(_write(runs, output))
    return 0


def _write(runs: list[Run], output: Path) -> str:
    text = table(runs) + "\n\n" + "\n".join(depth_checks(runs))
    (output / "scale.md").write_text(text + "\n", encoding="utf-8")
    write_json(output / "scale.json", {"environment": environment(), "runs": [asdict(run) for run in runs]})
    if not plot(runs, output / "scale.png"):
        text += "\n(no plot: matplotlib is not installed; pip install quantlab[bench])"
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("scale-results"), help="where the table, JSON, PNG go")
    parser.add_argument("--scratch", type=Path, default=None, help="where checkpoints go (default: under --output)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    defaults = [name for name, shape in SHAPES.items() if shape.in_default_run]
    parser.add_argument("--shapes", type=_names(SHAPES), default=defaults, help=f"of {', '.join(SHAPES)}")
    parser.add_argument(
        "--methods",
        type=_names({"rtn": 0, "gptq": 0, **QAT_METHODS}),
        default=["rtn", "gptq"],
        help="rtn, gptq, qat-grids (scales and zero points trained), qat-weights (every weight trained)",
    )
    parser.add_argument("--all-methods", action="store_true", help="also GPTQ on the shapes that run RTN only")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of the checkpoints")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=32, help="GPTQ calibration windows")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each (shape, method), for the spread")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--qat-steps", type=int, default=4, help="QAT: optimizer steps a run")
    parser.add_argument("--qat-batch", type=int, default=1, help="QAT: examples of --seq-len tokens a step")
    parser.add_argument("--activation-checkpointing", action="store_true", help="QAT: recompute activations")
    parser.add_argument("--teacher-weights", choices=["float32", "bfloat16"], default="float32", help="QAT's teacher")
    return parser.parse_args(argv)


def _names(known: dict[str, Any]):
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}")
        return names

    return parse


if __name__ == "__main__":
    sys.exit(main())
