"""`quantlab distill --teacher T --student S --max-steps N --output-dir DIR`: train a student to match a teacher.

The teacher (float, quantized or sparse checkpoint) runs frozen; the student learns from
`alpha * T^2 * KL + (1 - alpha) * CE` on transformers' Trainer: all its weights but the
embeddings, or LoRA adapters (`--lora-r`, required for a quantized student, merged into it at
the end). A sparse student (written by `quantlab prune`) keeps its masks and is saved sparse.
Training text: the bundled WikiText-2 slice after the evaluation windows, or `--data FILE`.
DIR is the run folder (log, checkpoints, report); the student goes to DIR/final.

This module also holds the helpers `quantlab prune --max-steps` shares.
"""

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from quantlab.cli.console import Console, add_output_options, disk_size, key_value_table, seconds
from quantlab.cli.evaluation import TextSpec, add_eval_arguments, measure_perplexity, read_text
from quantlab.cli.models import (
    float_checkpoint,
    load_model,
    load_tokenizer,
    model_class,
    quantization_method_of,
    read_config,
    resolve_model,
    save_checkpoint,
    weights_size,
)
from quantlab.cli.output import write_report
from quantlab.cli.training_flags import (
    add_training_flags,
    check_training_values,
    prepare_run_folder,
    resolve_training_flags,
    training_arguments,
)
from quantlab.errors import QuantlabError
from quantlab.training import FINAL_DIR

# -- options shared with `quantlab prune` -------------------------------------------------------------


def add_distillation_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("distillation loss")
    group.add_argument("--alpha", type=float, default=0.5, help="share of the KL term (default: 0.5)")
    group.add_argument("--temperature", type=float, default=2.0, help="softmax temperature T (default: 2.0)")
    group.add_argument(
        "--hidden-weight", type=float, default=0.0, help="weight of last-hidden-state matching (default: 0, off)"
    )


def distillation_config(args: argparse.Namespace):
    from quantlab.distill import DistillationConfig

    return DistillationConfig(alpha=args.alpha, temperature=args.temperature, hidden_weight=args.hidden_weight)


def training_data(args: argparse.Namespace, tokenizer: Any):
    """Training examples and the held-out windows (`--eval-windows` x `--eval-seq-len`) kept out of them."""
    from quantlab.training import bundled_data, causal_lm_data, read_documents

    if tokenizer is None:
        raise QuantlabError("training needs the model's tokenizer, and the model folder has none")
    windows = {"eval_windows": args.eval_windows, "eval_seq_len": args.eval_seq_len}
    if args.data is None:
        return bundled_data(tokenizer, seq_len=args.max_seq_length, **windows)
    documents = read_documents(Path(args.data).expanduser(), text_field=args.text_field)
    return causal_lm_data(tokenizer, documents, seq_len=args.max_seq_length, **windows)


def load_checkpoint(folder: Path) -> Any:
    """A float, quantized or sparse checkpoint (a sparse one with its pruning masks), in eval mode."""
    import torch

    from quantlab.prune import is_sparse_checkpoint, load_sparse

    cls = model_class(read_config(folder))
    if is_sparse_checkpoint(folder):
        return load_sparse(folder, dtype=torch.float32)
    return load_model(folder, cls, dtype=torch.float32)


def is_quantized(folder: Path) -> bool:
    return quantization_method_of(read_config(folder)) is not None


def freeze_embeddings(model: Any) -> None:
    """Train the decoder layers only: the (often tied) embeddings and output head stay as they are."""
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            module.requires_grad_(False)


def data_inputs(args: argparse.Namespace) -> list[Path]:
    """The training data file, which `--overwrite` must never delete."""
    return [Path(args.data).expanduser()] if args.data else []


def eval_windows(args: argparse.Namespace, data: Any) -> Any:
    """The held-out windows the loop measures every `--eval-steps` steps (None: no evaluation in the loop)."""
    return data.eval_windows if args.eval_steps and args.eval_windows else None


def last_loss(output: Path) -> float | None:
    """The loss of the run's last logged step."""
    from quantlab.training.reporting import read_log

    losses = [record["loss"] for record in read_log(output) if "loss" in record]
    return losses[-1] if losses else None


def save_model(model: Any, tokenizer: Any, output: Path, protect: list[Path]) -> None:
    """Sparse storage when the model carries pruning masks, `save_pretrained` otherwise (atomically).

    `protect`: the input models, which `overwrite` must never delete.
    """
    from quantlab.prune import masked_layers, save_sparse
    from quantlab.utils.atomic import atomic_directory

    if masked_layers(model):
        save_sparse(model, output, tokenizer=tokenizer, overwrite=True, protect=protect)
        return
    with atomic_directory(output, overwrite=True, protect=protect) as staging:
        save_checkpoint(model, tokenizer, staging)


# -- the command --------------------------------------------------------------------------------------


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


@dataclasses.dataclass
class DistillReport:
    teacher: str
    student: str
    output: str
    steps: int
    alpha: float
    temperature: float
    hidden_weight: float
    lora_r: int | None
    loss: float | None
    train_seconds: float
    size_bytes: int
    perplexity_teacher: float | None = None
    perplexity_before: float | None = None
    perplexity_after: float | None = None
    evaluation_text: str | None = None

    def as_table(self) -> str:
        rows = [
            ("loss", f"alpha={self.alpha:g}, T={self.temperature:g}, hidden_weight={self.hidden_weight:g}"),
            ("training", f"{self.steps} steps, {seconds(self.train_seconds)}, final loss {self.loss:.4f}"),
            ("student", f"LoRA r={self.lora_r} (merged)" if self.lora_r else "all weights but embeddings"),
            ("size on disk", disk_size(self.size_bytes)),
        ]
        if self.perplexity_after is not None:
            rows.append(
                (
                    "perplexity",
                    f"teacher {self.perplexity_teacher:.3f}; student {self.perplexity_before:.3f} -> "
                    f"{self.perplexity_after:.3f} on {self.evaluation_text}",
                )
            )
        return key_value_table(f"distilled {self.teacher} into {self.student} -> {self.output}", rows)


def run(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    resolve_training_flags(args, "distill")
    check_training_values(args, steps_required=True)
    distillation = distillation_config(args)
    if args.lora_r is not None and args.lora_r < 1:
        raise QuantlabError("--lora-r must be at least 1")
    output = Path(args.output_dir).expanduser()
    text = read_text(args, seq_len=args.eval_seq_len, windows=args.eval_windows) if args.eval else None
    teacher_source, student_source = resolve_model(args.teacher), resolve_model(args.student)
    prepare_run_folder(output, args, [teacher_source.path, student_source.path, *data_inputs(args)])
    with (
        float_checkpoint(teacher_source, scratch=output.parent, progress=console.progress) as teacher_folder,
        float_checkpoint(student_source, scratch=output.parent, progress=console.progress) as student_folder,
    ):
        report = distill_checkpoints(args, teacher_folder, student_folder, output, distillation, text, console)
    report.teacher, report.student = str(teacher_source), str(student_source)
    console.report(report.as_table(), {"command": "distill", **dataclasses.asdict(report)})
    return 0


def distill_checkpoints(
    args: argparse.Namespace,
    teacher_folder: Path,
    student_folder: Path,
    output: Path,
    distillation: Any,
    text: TextSpec | None,
    console: Console,
) -> DistillReport:
    from quantlab.distill import DistillationTrainer, check_vocabularies

    quantized_student = is_quantized(student_folder)
    if quantized_student and args.lora_r is None:
        raise QuantlabError(
            f"the student {student_folder} is quantized: its weights cannot train directly; pass --lora-r R to "
            f"train LoRA adapters on it (merged into it at the end)"
        )
    teacher_tokenizer, student_tokenizer = load_tokenizer(teacher_folder), load_tokenizer(student_folder)
    tokenizer = student_tokenizer or teacher_tokenizer
    console.note(f"loading the teacher {teacher_folder} and the student {student_folder}")
    teacher, student = load_checkpoint(teacher_folder), load_checkpoint(student_folder)
    check_vocabularies(teacher, student, teacher_tokenizer, student_tokenizer)
    report = DistillReport(
        teacher=str(teacher_folder), student=str(student_folder), output=str(output / FINAL_DIR), steps=args.max_steps,
        alpha=distillation.alpha, temperature=distillation.temperature, hidden_weight=distillation.hidden_weight,
        lora_r=args.lora_r, loss=None, train_seconds=0.0, size_bytes=0,
    )  # fmt: skip
    if text is not None:
        console.note(f"measuring perplexity on {text.describe()}")
        report.perplexity_teacher = measure_perplexity(teacher, tokenizer, text, console)
        report.perplexity_before = measure_perplexity(student, tokenizer, text, console)
        report.evaluation_text = text.describe()
    trainable = _prepare_student(student, args.lora_r, quantized_student)
    data = training_data(args, tokenizer)
    from quantlab.training import CausalLMCollator

    started = time.perf_counter()
    windows = eval_windows(args, data)
    eval_steps = args.eval_steps if windows is not None else 0
    training_args = training_arguments(args, console, eval_steps=eval_steps)
    trainer = DistillationTrainer(
        trainable, teacher, training_args, data.train, distillation=distillation, eval_windows=windows,
        data_collator=CausalLMCollator.for_tokenizer(tokenizer), save_final=False,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    report.loss, report.train_seconds = last_loss(output), time.perf_counter() - started
    student = _finish_student(trainable, args.lora_r, quantized_student)
    del teacher
    if text is not None:
        report.perplexity_after = measure_perplexity(student, tokenizer, text, console)
    save_model(student, tokenizer, output / FINAL_DIR, protect=[teacher_folder, student_folder])
    report.size_bytes = weights_size(output / FINAL_DIR)
    write_report(output, dataclasses.asdict(report))
    return report


def _prepare_student(student: Any, lora_r: int | None, quantized: bool) -> Any:
    from peft import prepare_model_for_kbit_training

    from quantlab.training import add_lora

    student.train()
    if lora_r is None:
        freeze_embeddings(student)
        return student
    if quantized:
        prepare_model_for_kbit_training(student, use_gradient_checkpointing=False)  # Trainer turns checkpointing on
    return add_lora(student, r=lora_r, alpha=2 * lora_r, dropout=0.0)


def _finish_student(trained: Any, lora_r: int | None, quantized: bool) -> Any:
    """The plain student: LoRA merged (re-quantized if the base is), pruning masks re-applied after a merge."""
    from quantlab.prune import attach_mask, mask_of, masked_layers
    from quantlab.training import merge_to_float, merge_to_quantized

    if lora_r is None:
        return trained.eval()
    masks = {_base_name(name): mask_of(layer) for name, layer in masked_layers(trained).items()}
    merged = merge_to_quantized(trained) if quantized else merge_to_float(trained)
    modules = dict(merged.named_modules())
    for name, mask in masks.items():
        attach_mask(modules[name], mask)  # the dense LoRA update is pruned back to the student's pattern
    return merged.eval()


def _base_name(name: str) -> str:
    return name.removeprefix("base_model.model.").removesuffix(".base_layer")
