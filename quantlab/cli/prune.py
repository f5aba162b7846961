"""`quantlab prune [MODEL] --pattern P [--sparsity S] --output-dir DIR`: prune, optionally recover, save.

The work is `quantlab.workflows.prune.prune_model`:
- `unstructured` / `N:M` (`2:4`, `4:8`): magnitude pruning of every Linear layer but the
  output head, stored compactly; `quantlab.prune.load_sparse(DIR/final)` reloads it with its masks.
- `structured`: `--sparsity` of every layer's MLP neurons (and `--head-sparsity` of its
  attention heads) are removed; the checkpoint is an ordinary smaller model.

The model goes to DIR/final; DIR is the run folder (log, checkpoints, report).
`--max-steps N` then trains the pruned model with its masks held; `--distill-from TEACHER`
makes that training a distillation from TEACHER (the unpruned model, typically).
"""

import argparse

from quantlab.cli.console import Console, add_output_options, disk_size, seconds
from quantlab.cli.distill import add_distillation_arguments, distillation_config
from quantlab.cli.eval_flags import add_eval_arguments, text_from_args
from quantlab.cli.options import add_model_argument, finite_float
from quantlab.cli.training_flags import add_training_flags, print_report, resolve_training_flags
from quantlab.workflows.prune import PruneReport, prune_model


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
        type=finite_float,
        metavar="S",
        help="fraction in [0, 1) of weights (structured: of MLP neurons) to remove; fixed by N:M patterns",
    )
    parser.add_argument(
        "--head-sparsity", type=finite_float, default=0.0, metavar="H", help="structured: fraction of attention heads"
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
    console = Console.from_args(args)
    training_run = resolve_training_flags(args, "prune")
    distillation = distillation_config(args) if args.distill_from else None
    text = text_from_args(args, seq_len=args.eval_seq_len, windows=args.eval_windows) if args.eval else None
    report = prune_model(
        args.model,
        training_run,
        args.pattern,
        args.sparsity,
        head_sparsity=args.head_sparsity,
        scope=args.scope,
        calibration_samples=args.calibration_samples,
        teacher=args.distill_from,
        distillation=distillation,
        evaluate=text,
        progress=console.progress,
        notify=console.note,
    )
    print_report(console, f"pruned {report.model} -> {report.output}", report_rows(report), report.as_dict())
    return 0


def report_rows(report: PruneReport) -> list[tuple[str, str]]:
    """The report's lines for people."""
    before, after = report.size_before_bytes, report.size_after_bytes
    sizes = f"{disk_size(before)} -> {disk_size(after)} ({after / before:.2f}x)"
    if report.linear_weights_stored_ratio is not None:
        sizes += f"; pruned Linear weights stored at {report.linear_weights_stored_ratio:.3f}x their dense size"
    rows = [
        ("pattern", f"{report.pattern}, {report.achieved_sparsity:.1%} removed in {report.layers_pruned} layers"),
        ("parameters", f"{report.parameters_before:,} -> {report.parameters_after:,}"),
        ("size on disk", sizes),
        ("time", f"{seconds(report.prune_seconds)} prune"),
    ]
    if report.finetune_steps:
        how = f"distilled from {report.teacher}" if report.teacher else "fine-tuned"
        rows.append(("recovery", f"{how}, {report.finetune_steps} steps, {seconds(report.finetune_seconds)}, "
                     f"final loss {report.finetune_loss:.4f}"))  # fmt: skip
    perplexity = [
        p for p in (report.perplexity_before, report.perplexity_pruned, report.perplexity_after) if p is not None
    ]
    if perplexity:
        labels = ("dense", "pruned", "recovered")
        line = " -> ".join(f"{value:.3f} {label}" for value, label in zip(perplexity, labels, strict=False))
        rows.append(("perplexity", f"{line} on {report.evaluation_text}"))
    return rows
