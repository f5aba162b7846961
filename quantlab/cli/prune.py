"""`quantlab prune [MODEL] --pattern P [--sparsity S] --output-dir DIR`: prune, optionally recover, save.

- `unstructured` / `N:M` (`2:4`, `4:8`): magnitude pruning of every Linear layer but the
  output head; the checkpoint stores the sparse weights compactly (`quantlab.prune.storage`),
  and `quantlab.prune.load_sparse(DIR)` reloads it with its masks.
- `structured`: `--sparsity` of every layer's MLP neurons (and `--head-sparsity` of its
  attention heads) are removed, the matrices shrink, and the checkpoint is an ordinary smaller
  model that `from_pretrained` loads as is. Neurons are scored on `--calibration-samples`
  training examples (0: by weight norms).

The model goes to DIR/final; DIR is the run folder (log, checkpoints, report).
`--max-steps N` then trains the pruned model on transformers' Trainer, with its masks held;
`--distill-from TEACHER` makes that training a distillation from TEACHER (the unpruned model,
typically), which recovers more than plain fine-tuning.
"""

import argparse
import time
from pathlib import Path
from typing import Any

from quantlab.cli.console import Console, add_output_options, disk_size, seconds
from quantlab.cli.distill import add_distillation_arguments, distillation_config
from quantlab.cli.evaluation import add_eval_arguments, measure_perplexity, read_text
from quantlab.cli.models import add_model_argument, float_checkpoint, load_tokenizer, resolve_model, weights_size
from quantlab.cli.training_flags import (
    add_training_flags,
    finish_run,
    prepare_run_folder,
    resolve_training_flags,
    training_arguments,
    training_data,
)
from quantlab.errors import QuantlabError
from quantlab.loading import load_checkpoint, quantization_method_of, read_config
from quantlab.saving import save_model
from quantlab.training import FINAL_DIR


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prune",
        help="prune a model (unstructured, N:M or structured) and save it compactly",
        description="Magnitude-prune the Linear layers of a model (unstructured or N:M, stored as bitmask + "
        "values), or remove MLP neurons and attention heads (structured: smaller matrices), optionally "
        "fine-tune or distill to recover, and save a checkpoint.",
    )
    add_model_argument(parser)
    parser.add_argument(
        "--pattern", required=True, metavar="P", help="unstructured, structured, or N:M such as 2:4 and 4:8"
    )
    parser.add_argument(
        "--sparsity",
        type=float,
        metavar="S",
        help="fraction in [0, 1) of weights (structured: of MLP neurons) to remove; fixed by N:M patterns",
    )
    parser.add_argument(
        "--head-sparsity", type=float, default=0.0, metavar="H", help="structured: fraction of attention heads"
    )
    parser.add_argument(
        "--scope", default="layer", choices=("layer", "global"), help="unstructured: sparsity per layer or global"
    )
    parser.add_argument(
        "--calibration-samples",
        type=int,
        default=8,
        metavar="N",
        help="structured: training examples scoring neurons by activation (default: 8; 0: weight norms)",
    )
    parser.add_argument(
        "--distill-from", metavar="TEACHER", help="recover by distillation from this model (needs --max-steps)"
    )
    add_distillation_arguments(parser)
    add_training_flags(parser)
    add_eval_arguments(parser, help="measure perplexity before and after", window_flags=False)
    add_output_options(parser)


def run(args: argparse.Namespace) -> int:
    from quantlab.prune import parse_pattern
    from quantlab.prune.pipeline import first_examples, pattern_sparsity, prune_by_pattern

    console = Console.from_args(args)
    resolve_training_flags(args, "prune")
    pattern = parse_pattern(args.pattern)
    sparsity = pattern_sparsity(pattern, args.sparsity, args.head_sparsity)
    if args.distill_from and not args.max_steps:
        raise QuantlabError("--distill-from trains the pruned model from a teacher: give --max-steps N too")
    text = read_text(args, seq_len=args.eval_seq_len, windows=args.eval_windows) if args.eval else None
    if args.model is None:
        console.note("using the embedded SmolLM2-135M-Instruct (converted into the cache on first use)")
    source = resolve_model(args.model)
    teacher = resolve_model(args.distill_from) if args.distill_from else None
    inputs = [source.path, *([teacher.path] if teacher else [])]
    output = prepare_run_folder(args, inputs)
    with float_checkpoint(source, scratch=output.parent, progress=console.progress) as folder:
        if quantization_method_of(read_config(folder)) is not None:
            raise QuantlabError(f"{source} is quantized; prune its float original, then quantize the pruned model")
        tokenizer = load_tokenizer(folder)
        if (text is not None or args.max_steps) and tokenizer is None:
            raise QuantlabError(f"{source} has no tokenizer, which --eval and --max-steps need")
        model = load_checkpoint(folder)
        report: dict[str, Any] = {"command": "prune", "model": str(source), "output": str(output / FINAL_DIR)}
        report |= {"pattern": str(pattern), "sparsity": sparsity, "teacher": None, "finetune_steps": 0}
        report["parameters_before"] = sum(p.numel() for p in model.parameters())
        perplexity = [measure_perplexity(model, tokenizer, text, console)] if text is not None else []
        console.note(f"pruning {source}: {pattern}")
        started = time.perf_counter()
        calibration = None
        if pattern.kind == "structured" and args.calibration_samples > 0 and tokenizer is not None:
            calibration = first_examples(training_data(args, tokenizer).train, args.calibration_samples)
        outcome = prune_by_pattern(
            model, pattern, sparsity, scope=args.scope, head_sparsity=args.head_sparsity, calibration=calibration
        )
        report |= {"achieved_sparsity": outcome.sparsity, "layers_pruned": outcome.layers}
        report["prune_seconds"] = time.perf_counter() - started
        report["parameters_after"] = sum(p.numel() for p in model.parameters())
        report["head_sparsity"] = args.head_sparsity if pattern.kind == "structured" else None
        if text is not None:
            perplexity.append(measure_perplexity(model, tokenizer, text, console))
        if args.max_steps:
            _recover(args, model, tokenizer, teacher, output, report, console)
            if text is not None:
                perplexity.append(measure_perplexity(model, tokenizer, text, console))
        save_model(model, tokenizer, output / FINAL_DIR, protect=inputs)
    _report(args, report, source, pattern, output, text, perplexity, console)
    return 0


def _recover(args, model: Any, tokenizer: Any, teacher: Any, output: Path, report: dict, console: Console) -> None:
    """Train the pruned model (masks held) for `--max-steps`, or distill it from `--distill-from`."""
    from quantlab.prune.pipeline import recover

    started, data = time.perf_counter(), training_data(args, tokenizer)
    windows = data.eval_windows if args.eval_steps and args.eval_windows else None
    training_args = training_arguments(args, console, eval_steps=args.eval_steps if windows is not None else 0)
    options = {"eval_windows": windows, "resume_from_checkpoint": args.resume_from_checkpoint}
    if teacher is not None:
        with float_checkpoint(teacher, scratch=output.parent, progress=console.progress) as folder:
            options |= {"teacher": load_checkpoint(folder), "teacher_tokenizer": load_tokenizer(folder)}
        options["distillation"], report["teacher"] = distillation_config(args), str(teacher)
        console.note(f"distilling from {teacher} for {args.max_steps} steps")
    losses = recover(model, training_args, data.train, tokenizer, **options)
    report |= {"finetune_steps": args.max_steps, "finetune_loss": losses[-1] if losses else None}
    report["finetune_seconds"] = time.perf_counter() - started


def _report(args, report: dict, source, pattern, output: Path, text, perplexity: list[float], console) -> None:
    from quantlab.prune import sparse_storage

    before, after = weights_size(source.path), weights_size(output / FINAL_DIR)
    stored = sparse_storage(output / FINAL_DIR).ratio() if pattern.kind != "structured" else None
    report |= {"size_before_bytes": before, "size_after_bytes": after, "linear_weights_stored_ratio": stored}
    names = ("perplexity_before", "perplexity_pruned", "perplexity_after")
    report |= dict(zip(names, [*perplexity, None, None, None], strict=False))
    report["evaluation_text"] = text.describe() if text is not None else None
    sizes = f"{disk_size(before)} -> {disk_size(after)} ({after / before:.2f}x)"
    if stored is not None:
        sizes += f"; pruned Linear weights stored at {stored:.3f}x their dense size"
    rows = [
        ("pattern", f"{pattern}, {report['achieved_sparsity']:.1%} removed in {report['layers_pruned']} layers"),
        ("parameters", f"{report['parameters_before']:,} -> {report['parameters_after']:,}"),
        ("size on disk", sizes),
        ("time", f"{seconds(report['prune_seconds'])} prune"),
    ]
    if report["finetune_steps"]:
        how = f"distilled from {report['teacher']}" if report["teacher"] else "fine-tuned"
        rows.append(("recovery", f"{how}, {report['finetune_steps']} steps, {seconds(report['finetune_seconds'])}, "
                     f"final loss {report['finetune_loss']:.4f}"))  # fmt: skip
    if perplexity:
        labels = ("dense", "pruned", "recovered")
        line = " -> ".join(f"{value:.3f} {label}" for value, label in zip(perplexity, labels, strict=False))
        rows.append(("perplexity", f"{line} on {report['evaluation_text']}"))
    finish_run(console, output, f"pruned {report['model']} -> {report['output']}", rows, report)
