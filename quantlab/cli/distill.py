"""`quantlab distill --teacher T --student S --max-steps N --output-dir DIR`: train a student to match a teacher.

The teacher (float, quantized or sparse checkpoint) runs frozen; the student learns from
`alpha * T^2 * KL + (1 - alpha) * CE` on transformers' Trainer: all its weights but the
embeddings, or LoRA adapters (`--lora-r`, required for a quantized student, merged into it at
the end). A sparse student (written by `quantlab prune`) keeps its masks and is saved sparse.
DIR is the run folder (log, checkpoints, report); the student goes to DIR/final.
"""

import argparse
import time
from pathlib import Path

from quantlab.cli.console import Console, add_output_options, disk_size, seconds
from quantlab.cli.evaluation import add_eval_arguments, measure_perplexity, read_text
from quantlab.cli.models import float_checkpoint, load_tokenizer, resolve_model
from quantlab.cli.training_flags import (
    add_training_flags,
    finish_run,
    prepare_run_folder,
    resolve_training_flags,
    training_arguments,
    training_data,
)
from quantlab.errors import QuantlabError
from quantlab.loading import load_checkpoint, weights_size
from quantlab.training import FINAL_DIR


def add_distillation_arguments(parser: argparse.ArgumentParser) -> None:
    """The loss options, shared with `quantlab prune --distill-from`."""
    group = parser.add_argument_group("distillation loss")
    group.add_argument("--alpha", type=float, default=0.5, help="share of the KL term (default: 0.5)")
    group.add_argument("--temperature", type=float, default=2.0, help="softmax temperature T (default: 2.0)")
    group.add_argument(
        "--hidden-weight", type=float, default=0.0, help="weight of last-hidden-state matching (default: 0, off)"
    )


def distillation_config(args: argparse.Namespace):
    from quantlab.distill import DistillationConfig

    return DistillationConfig(alpha=args.alpha, temperature=args.temperature, hidden_weight=args.hidden_weight)


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
    resolve_training_flags(args, "distill")
    distillation = distillation_config(args)
    if args.lora_r is not None and args.lora_r < 1:
        raise QuantlabError("--lora-r must be at least 1")
    text = read_text(args, seq_len=args.eval_seq_len, windows=args.eval_windows) if args.eval else None
    teacher_source, student_source = resolve_model(args.teacher), resolve_model(args.student)
    output = prepare_run_folder(args, [teacher_source.path, student_source.path])
    with (
        float_checkpoint(teacher_source, scratch=output.parent, progress=console.progress) as teacher_folder,
        float_checkpoint(student_source, scratch=output.parent, progress=console.progress) as student_folder,
    ):
        names = (str(teacher_source), str(student_source))
        _distill(args, teacher_folder, student_folder, names, output, distillation, text, console)
    return 0


def _distill(args, teacher_folder, student_folder, names: tuple[str, str], output: Path, distillation, text, console):
    from quantlab.distill import check_student, check_vocabularies, distill
    from quantlab.loading import read_config
    from quantlab.saving import save_model

    check_student(read_config(student_folder), args.lora_r)
    teacher_tokenizer, student_tokenizer = load_tokenizer(teacher_folder), load_tokenizer(student_folder)
    tokenizer = student_tokenizer or teacher_tokenizer
    console.note(f"loading the teacher {teacher_folder} and the student {student_folder}")
    teacher, student = load_checkpoint(teacher_folder), load_checkpoint(student_folder)
    check_vocabularies(teacher, student, teacher_tokenizer, student_tokenizer)
    perplexity = {}
    if text is not None:
        console.note(f"measuring perplexity on {text.describe()}")
        perplexity = {name: measure_perplexity(model, tokenizer, text, console)
                      for name, model in (("teacher", teacher), ("before", student))}  # fmt: skip
    data = training_data(args, tokenizer)
    started = time.perf_counter()
    windows = data.eval_windows if args.eval_steps and args.eval_windows else None
    training_args = training_arguments(args, console, eval_steps=args.eval_steps if windows is not None else 0)
    student, losses = distill(
        student, teacher, training_args, data.train, tokenizer, lora_r=args.lora_r, distillation=distillation,
        eval_windows=windows, teacher_tokenizer=teacher_tokenizer, resume_from_checkpoint=args.resume_from_checkpoint,
    )  # fmt: skip
    train_seconds = time.perf_counter() - started
    del teacher
    if text is not None:
        perplexity["after"] = measure_perplexity(student, tokenizer, text, console)
    save_model(student, tokenizer, output / FINAL_DIR, protect=[teacher_folder, student_folder])
    report = {
        "command": "distill", "teacher": names[0], "student": names[1],
        "output": str(output / FINAL_DIR), "steps": args.max_steps, "alpha": distillation.alpha,
        "temperature": distillation.temperature, "hidden_weight": distillation.hidden_weight, "lora_r": args.lora_r,
        "loss": losses[-1] if losses else None, "train_seconds": train_seconds,
        "size_bytes": weights_size(output / FINAL_DIR),
        "perplexity_teacher": perplexity.get("teacher"), "perplexity_before": perplexity.get("before"),
        "perplexity_after": perplexity.get("after"), "evaluation_text": text.describe() if text else None,
    }  # fmt: skip
    rows = [
        ("loss", f"alpha={distillation.alpha:g}, T={distillation.temperature:g}, "
                 f"hidden_weight={distillation.hidden_weight:g}"),
        ("training", f"{args.max_steps} steps, {seconds(train_seconds)}, final loss {report['loss']:.4f}"),
        ("student", f"LoRA r={args.lora_r} (merged)" if args.lora_r else "all weights but embeddings"),
        ("size on disk", disk_size(report["size_bytes"])),
    ]  # fmt: skip
    if text is not None:
        rows.append(("perplexity", f"teacher {perplexity['teacher']:.3f}; student {perplexity['before']:.3f} -> "
                     f"{perplexity['after']:.3f} on {text.describe()}"))  # fmt: skip
    finish_run(console, output, f"distilled {names[0]} into {names[1]} -> {output}", rows, report)
