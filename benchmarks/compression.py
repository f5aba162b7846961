"""Pruning and distillation on SmolLM2-135M-Instruct: quality, recovery, size on disk, speed.

For each configuration (one-shot 2:4, 50 % unstructured, structured 25 % of MLP neurons), in
this order so the acceptance figures come first:
1. one-shot magnitude pruning (structured: neurons scored on 8 calibration examples of the
   training text), perplexity with the shared harness (WikiText-2, 16 x 512 tokens);
2. the checkpoint as quantlab writes it: size on disk against the dense checkpoint's, and the
   pruned Linear weights' stored size against their dense size;
3. recovery: `--steps` optimizer steps of distillation from the dense fp32 model on the shared
   Trainer (`quantlab.distill.DistillationTrainer`, masks held by `KeepMasks`), on the bundled
   WikiText-2 text after the evaluation windows, never on them; embeddings frozen; then the
   perplexity again, and the share of the one-shot perplexity gap recovered,
   `(ppl_one_shot - ppl_recovered) / (ppl_one_shot - ppl_dense)`.
The structured model's forward time is measured against the dense model's side by side in one
process, alternating calls, medians, on a harness window (1 x 512, all logits) and on a prefill
(4 x 128, logits of the last position only, as generation computes them).

Defaults (chosen to be affordable on 2 CPU cores shared with other jobs; a step costs about 4
forward passes of its tokens): batch 2 x 128 tokens, AdamW lr 1e-4 cosine with 10 warmup steps,
gradient clipping 1.0, loss alpha 0.5, temperature 1 (0.5 KL to the teacher + 0.5 cross-entropy),
fp32, one torch thread (on an oversubscribed machine two threads ran a forward pass slower than
one: each parallel region waits for its descheduled thread).

    python benchmarks/compression.py                          # everything (hours on a busy machine)
    python benchmarks/compression.py --configs 2:4 --steps 50 # a subset
    python benchmarks/compression.py --json compression.json  # also write the figures (after every stage)
    python benchmarks/compression.py --report a.json b.json   # one table from runs of subsets (in parallel)
"""

import argparse
import copy
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _common import default_text_path, environment, format_table, number, write_json
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantlab.assets.models import smollm2_dir
from quantlab.assets.text import read_text
from quantlab.distill import DistillationConfig, DistillationTrainer
from quantlab.eval import perplexity
from quantlab.prune import prune, prune_structured, save_sparse, sparse_storage
from quantlab.training import CausalLMCollator, bundled_data, read_log, training_arguments

CONFIGS = ("2:4", "unstructured", "structured")
WINDOWS, SEQ_LEN = 16, 512


@dataclass
class Row:
    config: str
    ppl_one_shot: float | None = None
    ppl_recovered: float | None = None
    gap_recovered: float | None = None
    sparsity: float | None = None
    size_on_disk_bytes: int | None = None
    dense_size_on_disk_bytes: int | None = None
    linear_weights_ratio: float | None = None
    parameters: int | None = None
    recovery_seconds: float | None = None
    recovery_loss: float | None = None


def main() -> int:
    args = parse_args()
    if args.report:
        print(merged_report(args.report))
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dense = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    dense.requires_grad_(False)
    text = read_text(args.text) if args.text else read_text(default_text_path())
    data = bundled_data(tokenizer, seq_len=args.seq_len)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    results: dict[str, Any] = {"environment": environment(), "settings": settings}
    results["timing"] = None
    rows: list[Row] = []

    def save() -> None:
        results["rows"] = [asdict(row) for row in rows]
        if args.json:
            write_json(args.json, results)

    started = time.perf_counter()
    results["ppl_dense"] = evaluate(dense, tokenizer, text, args)
    note(f"dense perplexity {results['ppl_dense']:.3f} ({time.perf_counter() - started:.0f} s)")
    save()
    for config in args.configs:
        row = Row(config)
        rows.append(row)
        student = copy.deepcopy(dense)
        one_shot(student, config, row, data)
        row.ppl_one_shot = evaluate(student, tokenizer, text, args)
        note(f"{config}: one-shot perplexity {row.ppl_one_shot:.3f}")
        measure_storage(student, config, row, folder)
        save()
        if config == "structured":
            results["timing"] = forward_timing(dense, student, args.timing_repeats)
            note(f"forward time, dense / structured: {results['timing']}")
            save()
        if args.steps:
            recover(student, dense, row, data, tokenizer, args)
            row.ppl_recovered = evaluate(student, tokenizer, text, args)
            gap = row.ppl_one_shot - results["ppl_dense"]
            row.gap_recovered = (row.ppl_one_shot - row.ppl_recovered) / gap if gap > 0 else None
            note(f"{config}: recovered perplexity {row.ppl_recovered:.3f} ({row.gap_recovered:.1%} of the gap)")
            save()
        del student
        gc.collect()
    save()
    print(report(results, args))
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    parser.add_argument("--steps", type=int, default=200, help="distillation steps per configuration (0: none)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per training example")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--windows", type=int, default=WINDOWS, help="perplexity windows of 512 tokens")
    parser.add_argument("--timing-repeats", type=int, default=10)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: on a shared, oversubscribed machine 2 is slower)"
    )
    parser.add_argument("--text", type=Path, help="evaluation text (default: WikiText-2 test, else the bundled one)")
    parser.add_argument("--json", type=Path, help="write the figures here (rewritten after every stage)")
    parser.add_argument("--report", type=Path, nargs="+", help="only print one table from these --json files")
    args = parser.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {CONFIGS}")
    return args


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def evaluate(model: torch.nn.Module, tokenizer: Any, text: str, args: argparse.Namespace) -> float:
    return perplexity(model, tokenizer, text, seq_len=SEQ_LEN, windows=args.windows)


def one_shot(model: torch.nn.Module, config: str, row: Row, data: Any) -> None:
    if config == "structured":
        calibration = [{"input_ids": data.train[i]["input_ids"].unsqueeze(0)} for i in range(8)]
        result = prune_structured(model, mlp_sparsity=0.25, calibration=calibration)
        row.sparsity = result.neuron_sparsity
    else:
        result = prune(model, config, 0.5 if config == "unstructured" else None)
        row.sparsity = result.achieved_sparsity
    row.parameters = sum(p.numel() for p in model.parameters())


def measure_storage(model: torch.nn.Module, config: str, row: Row, dense_folder: Path) -> None:
    row.dense_size_on_disk_bytes = sum(f.stat().st_size for f in dense_folder.glob("*.safetensors"))
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "model"
        if config == "structured":
            model.save_pretrained(target)
        else:
            save_sparse(model, target)
            row.linear_weights_ratio = sparse_storage(target).ratio()
        row.size_on_disk_bytes = sum(f.stat().st_size for f in target.glob("*.safetensors"))


def recover(student: torch.nn.Module, teacher: torch.nn.Module, row: Row, data: Any, tokenizer: Any, args) -> None:
    student.train()
    student.requires_grad_(True)
    for module in (student.get_input_embeddings(), student.get_output_embeddings()):
        module.requires_grad_(False)  # tied; the pruned decoder layers are what must adapt
    with tempfile.TemporaryDirectory() as run_dir:
        config = training_arguments(
            {
                "output_dir": run_dir,
                "max_steps": args.steps,
                "per_device_train_batch_size": args.batch_size,
                "learning_rate": args.learning_rate,
                "lr_scheduler_type": "cosine",
                "warmup_steps": min(10, args.steps // 10),
                "disable_tqdm": not sys.stderr.isatty(),
                "logging_steps": max(1, args.steps // 20),
            }
        )
        trainer = DistillationTrainer(
            student,
            teacher,
            config,
            data.train,
            distillation=DistillationConfig(alpha=args.alpha, temperature=args.temperature),
            data_collator=CausalLMCollator.for_tokenizer(tokenizer),
            save_final=False,
        )
        started = time.perf_counter()
        trainer.train()
        losses = [record["loss"] for record in read_log(run_dir) if "loss" in record]
        row.recovery_seconds, row.recovery_loss = time.perf_counter() - started, losses[-1]
    student.eval()


def forward_timing(dense: torch.nn.Module, pruned: torch.nn.Module, repeats: int) -> dict[str, Any]:
    """Median seconds per forward, alternating the two models call by call."""
    shapes = {"window 1x512, all logits": ((1, 512), 0), "prefill 4x128, last logits": ((4, 128), 1)}
    timing: dict[str, Any] = {}
    generator = torch.Generator().manual_seed(0)
    for label, (shape, keep) in shapes.items():
        x = torch.randint(0, dense.config.vocab_size, shape, generator=generator)
        seconds: dict[str, list[float]] = {"dense": [], "structured": []}
        with torch.inference_mode():
            for model in (dense, pruned):
                model(x, logits_to_keep=keep)  # warm-up
            for _ in range(repeats):
                for name, model in (("dense", dense), ("structured", pruned)):
                    start = time.perf_counter()
                    model(x, logits_to_keep=keep)
                    seconds[name].append(time.perf_counter() - start)
        dense_s, pruned_s = statistics.median(seconds["dense"]), statistics.median(seconds["structured"])
        timing[label] = {"dense_s": dense_s, "structured_s": pruned_s, "speedup": dense_s / pruned_s}
    return timing


def merged_report(paths: list[Path]) -> str:
    """The table of several runs (each on a subset of the configurations), rows in the usual order."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    rows = {row["config"]: row for run in runs for row in run.get("rows", [])}
    merged = dict(runs[0])
    merged["rows"] = [rows[config] for config in CONFIGS if config in rows]
    merged["timing"] = next((run["timing"] for run in runs if run.get("timing")), None)
    settings = runs[0]["settings"]
    args = argparse.Namespace(steps=settings["steps"], windows=settings["windows"])
    return report(merged, args)


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    dense = results["ppl_dense"]
    rows = []
    for row in results["rows"]:
        ratio = row["size_on_disk_bytes"] / row["dense_size_on_disk_bytes"] if row["size_on_disk_bytes"] else None
        rows.append(
            [
                row["config"],
                number(row["sparsity"], 3),
                number(row["ppl_one_shot"], 2),
                number(row["ppl_recovered"], 2),
                None if row["gap_recovered"] is None else f"{row['gap_recovered']:.1%}",
                None if ratio is None else f"{row['size_on_disk_bytes'] / 1e6:.1f} MB ({ratio:.2f}x)",
                number(row["linear_weights_ratio"], 3),
                number(row["recovery_seconds"], 0),
            ]
        )
    columns = [
        "pattern",
        "sparsity",
        "ppl one-shot",
        f"ppl after {args.steps} KD steps",
        "gap recovered",
        "size on disk (vs dense)",
        "pruned Linear stored / dense",
        "KD seconds",
    ]
    lines = [
        f"SmolLM2-135M-Instruct, dense fp32 perplexity {dense:.3f} ({args.windows} x {SEQ_LEN} tokens)",
        "",
        format_table(columns, rows),
    ]
    if results.get("timing"):
        lines += ["", "Forward time, structured (25 % of MLP neurons) vs dense, same process, alternating, medians:"]
        timing_rows = [
            [label, f"{t['dense_s'] * 1e3:.0f} ms", f"{t['structured_s'] * 1e3:.0f} ms", f"{t['speedup']:.2f}x"]
            for label, t in results["timing"].items()
        ]
        lines.append(format_table(["input", "dense", "structured", "speed-up"], timing_rows))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
