"""`quantlab distill --teacher T --student S --max-steps N --output-dir DIR`: train a student to match a teacher.

The work is `quantlab.workflows.distill.distill_model`: the teacher (float, quantized or sparse
checkpoint) runs frozen; the student learns from `alpha * T^2 * KL + (1 - alpha) * CE`: all its
weights but the embeddings, or LoRA adapters (`--lora-r`, required for a quantized student, merged
into it at the end). DIR is the run folder (log, checkpoints, report); the student goes to DIR/final.
"""

import argparse

from quantlab.cli.console import Console, add_output_options, disk_size, seconds
from quantlab.cli.eval_flags import add_eval_arguments, text_from_args
from quantlab.cli.options import finite_float
from quantlab.cli.training_flags import add_training_flags, print_report, resolve_training_flags
from quantlab.workflows.distill import DistillReport, distill_model


def add_distillation_arguments(parser: argparse.ArgumentParser) -> None:
    """The loss options, shared with `quantlab prune --distill-from`."""
    group = parser.add_argument_group("distillation loss")
    group.add_argument("--alpha", type=finite_float, default=0.5, help="share of the KL term (default: 0.5)")
    group.add_argument("--temperature", type=finite_float, default=2.0, help="softmax temperature T (default: 2.0)")
    group.add_argument(
        "--hidden-weight", type=finite_float, default=0.0, help="weight of last-hidden-state matching (default: 0, off)"
    )
    add_embedding_weight_flag(group)


def add_embedding_weight_flag(group: argparse._ArgumentGroup) -> None:
    """`--embedding-weight F`, shared with `quantlab qat`."""
    group.add_argument(
        "--embedding-weight",
        type=finite_float,
        default=0.0,
        metavar="F",
        help="an encoder: also match its mean-pooled sentence embeddings, one term per example, at F x the "
        "per-token term (default: 0, off)",
    )


def distillation_config(args: argparse.Namespace):
    from quantlab.distill import DistillationConfig

    return DistillationConfig(alpha=args.alpha, temperature=args.temperature, hidden_weight=args.hidden_weight,
                              embedding_weight=args.embedding_weight)  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "distill",
        help="distill a teacher model into a student (transformers' Trainer)",
        description="Train a student (float, pruned, or quantized with --lora-r) to match a frozen teacher "
        "(float or quantized) with alpha*T^2*KL + (1-alpha)*CE. Both must share a tokenizer.",
    )
    parser.add_argument("--teacher", required=True, metavar="T", help="teacher model folder or .gguf file")
    parser.add_argument("--student", required=True, metavar="S", help="student model folder (float, sparse, quantized)")
    parser.add_argument("--lora-r", type=int, metavar="R", help="train LoRA adapters of rank R (quantized students)")
    add_distillation_arguments(parser)
    add_training_flags(parser)
    add_eval_arguments(parser, help="measure the student's perplexity before and after", window_flags=False)
    add_output_options(parser)


def run(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    training_run = resolve_training_flags(args, "distill")
    distillation = distillation_config(args)
    text = text_from_args(args, seq_len=args.eval_seq_len, windows=args.eval_windows) if args.eval else None
    report = distill_model(
        args.teacher,
        args.student,
        training_run,
        lora_r=args.lora_r,
        distillation=distillation,
        evaluate=text,
        progress=console.progress,
        notify=console.note,
    )
    title = f"distilled {report.teacher} into {report.student} -> {training_run.output_dir}"
    print_report(console, title, report_rows(report), report.as_dict())
    return 0


def report_rows(report: DistillReport) -> list[tuple[str, str]]:
    """The report's lines for people."""
    loss = f"alpha={report.alpha:g}, T={report.temperature:g}, hidden_weight={report.hidden_weight:g}"
    if report.embedding_weight:
        loss += f", embedding_weight={report.embedding_weight:g}"
    rows = [
        ("loss", loss),
        ("training", f"{report.steps} steps, {seconds(report.train_seconds)}, final loss {report.loss:.4f}"),
        ("student", f"LoRA r={report.lora_r} (merged)" if report.lora_r else "all weights but embeddings"),
        ("size on disk", disk_size(report.size_bytes)),
    ]
    if report.evaluation_text is not None:
        rows.append(("perplexity", f"teacher {report.perplexity_teacher:.3f}; student {report.perplexity_before:.3f} "
                     f"-> {report.perplexity_after:.3f} on {report.evaluation_text}"))  # fmt: skip
    return rows
