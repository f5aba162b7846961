"""`quantlab qat [MODEL] [--method NAME ...] --max-steps N -o DIR`: quantization-aware training with distillation.

The work is `quantlab.workflows.qat.qat_model`: MODEL is a quantized checkpoint (trained as it is)
or a float model quantized first with `--method` and its options. Its quantized layers train through
fake quantizers (straight-through rounding, learnable scales) against the KL divergence from the
float teacher (`--teacher`, default the float model the checkpoint was quantized from), and are
written back in their storage format. An encoder trains against the cosine distance of its last
hidden states instead, and `--eval` reports its sentence embeddings' cosine to the teacher's.
DIR is the run folder (log, checkpoints, report); the trained checkpoint goes to DIR/final.
"""

import argparse

from quantlab.cli.console import Console, add_output_options, disk_size, mebibytes, seconds
from quantlab.cli.distill import add_embedding_weight_flag
from quantlab.cli.eval_flags import add_eval_arguments, text_from_args
from quantlab.cli.options import (
    add_dataclass_flags,
    add_method_argument,
    add_model_argument,
    add_preset_argument,
    config_from_args,
    dataclass_from_args,
    finite_float,
)
from quantlab.cli.training_flags import add_training_flags, print_report, resolve_training_flags
from quantlab.qat.options import QATOptions
from quantlab.workflows.qat import QATReport, qat_model

_QAT_OPTION = "qat_option."  # where the flags of QATOptions' fields keep their values


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "qat",
        help="quantization-aware training of a quantized model against its float model",
        description="Train a quantized checkpoint (or a float MODEL quantized first with --method) through fake "
        "quantizers on its own storage format, with the KL divergence from the float teacher as the loss, and "
        "save it in the same format. --learning-rate is in grid steps (one code of an integer grid).",
    )
    add_model_argument(parser, help="a quantized checkpoint, or a float model with --method (default: the embedded "
                       "SmolLM2-135M-Instruct)")  # fmt: skip
    add_method_argument(parser, required=False)
    add_preset_argument(parser)
    parser.add_argument(
        "--teacher",
        metavar="FLOAT_MODEL",
        help="the float model to match (default: the one the checkpoint was quantized from)",
    )
    group = parser.add_argument_group("quantization-aware training")
    group.add_argument(
        "--teacher-weights",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype the teacher's Linear weights are held in; bfloat16 halves the teacher's memory and still "
        "computes in float32 (default: float32)",
    )
    add_dataclass_flags(group, QATOptions, _QAT_OPTION)
    group.add_argument(
        "--alpha",
        type=finite_float,
        default=1.0,
        help="share of the KL term; the rest is cross-entropy on the text (default: 1, KL only)",
    )
    group.add_argument(
        "--temperature", type=finite_float, default=1.0, help="softmax temperature of the KL (default: 1)"
    )
    add_embedding_weight_flag(group)
    add_training_flags(parser)
    add_eval_arguments(parser, help="measure the teacher's and the student's perplexity before and after (an encoder: "
                       "its sentence embeddings' cosine to the teacher's on the first 256 lines)",
                       window_flags=False)  # fmt: skip
    add_output_options(parser)


def run(args: argparse.Namespace) -> int:
    from quantlab.distill import DistillationConfig

    console = Console.from_args(args)
    training_run = resolve_training_flags(args, "qat")
    options = dataclass_from_args(QATOptions, args, _QAT_OPTION)
    distillation = DistillationConfig(alpha=args.alpha, temperature=args.temperature,
                                      embedding_weight=args.embedding_weight)  # fmt: skip
    config = config_from_args(args) if args.method is not None or args.preset is not None else None
    text = text_from_args(args, seq_len=args.eval_seq_len, windows=args.eval_windows) if args.eval else None
    report = qat_model(
        args.model,
        training_run,
        teacher=args.teacher,
        config=config,
        options=options,
        distillation=distillation,
        evaluate=text,
        teacher_weights=args.teacher_weights,
        progress=console.progress,
        notify=console.note,
    )
    title = f"quantization-aware training of {report.model} -> {training_run.output_dir}"
    print_report(console, title, report_rows(report), report.as_dict())
    return 0


def report_rows(report: QATReport) -> list[tuple[str, str]]:
    """The report's lines for people."""
    start = "quantized first" if report.quantized_first else "as saved"
    bound = "unbounded" if report.max_offset is None else f"within {report.max_offset:g} grid steps"
    if report.trained == "grids":
        trained = "scales and zero points (codes frozen)"
    else:
        trained = f"weights {bound}, scales {'learned' if report.learn_scales else 'fixed'}"
    norms = "frozen" if report.norm_lr_ratio is None else f"trained at {report.norm_lr_ratio:g} x lr"
    tables = "frozen" if report.embedding_lr_ratio is None else f"trained at {report.embedding_lr_ratio:g} x lr"
    per_step = "" if report.step_seconds_median is None else f" ({report.step_seconds_median:.1f} s a step)"
    embedding = f", sentence embeddings at {report.embedding_weight:g}" if report.embedding_weight else ""
    losses = "" if report.loss_first is None else f", loss {report.loss_first:.4f} -> {report.loss_last:.4f}"
    rows = [
        ("student", f"{report.method} ({start}), {report.layers_trained} layers, "
                    f"{report.layers_from_float_weights} from the teacher's float weights"),
        ("teacher", report.teacher),
        ("trained", f"{trained}, norms {norms}, embedding tables {tables}; loss alpha={report.alpha:g}, "
                    f"T={report.temperature:g}{embedding}; teacher weights in {report.teacher_weights}"),
        ("training", f"{report.steps} steps at lr {report.learning_rate:g}, {seconds(report.train_seconds)}{per_step}, "
                     f"peak {mebibytes(report.peak_memory_bytes)} (predicted "
                     f"{mebibytes(report.predicted_peak_memory_bytes)}){losses}"),
        ("size on disk", f"{disk_size(report.size_bytes)}, {report.bits_per_quantized_weight:.3f} bits per weight"),
    ]  # fmt: skip
    if report.embedding_cosine_after is not None:
        rows.append(("embedding cosine", f"to the teacher {report.embedding_cosine_before:.5f} -> "
                     f"{report.embedding_cosine_after:.5f} on {report.evaluation_text}"))  # fmt: skip
    elif report.evaluation_text is not None:
        rows.append(("perplexity", f"teacher {report.perplexity_teacher:.3f}; student {report.perplexity_before:.3f} "
                     f"-> {report.perplexity_after:.3f} on {report.evaluation_text}"))  # fmt: skip
    return rows
