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
import dataclasses
import time
from pathlib import Path
from typing import Any

from quantlab.cli.console import Console, add_output_options, disk_size, key_value_table, seconds
from quantlab.cli.distill import (
    add_distillation_arguments,
    data_inputs,
    distillation_config,
    eval_windows,
    freeze_embeddings,
    is_quantized,
    last_loss,
    load_checkpoint,
    save_model,
    training_data,
)
from quantlab.cli.evaluation import TextSpec, add_eval_arguments, measure_perplexity, read_text
from quantlab.cli.models import (
    ModelSource,
    add_model_argument,
    float_checkpoint,
    load_tokenizer,
    resolve_model,
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


@dataclasses.dataclass
class PruneReport:
    model: str
    output: str
    pattern: str
    sparsity: float
    achieved_sparsity: float
    layers_pruned: int
    parameters_before: int
    parameters_after: int
    size_before_bytes: int
    size_after_bytes: int
    prune_seconds: float
    linear_weights_stored_ratio: float | None = None
    head_sparsity: float | None = None
    finetune_steps: int = 0
    teacher: str | None = None
    finetune_loss: float | None = None
    finetune_seconds: float | None = None
    perplexity_before: float | None = None
    perplexity_pruned: float | None = None
    perplexity_after: float | None = None
    evaluation_text: str | None = None

    def as_table(self) -> str:
        sizes = f"{disk_size(self.size_before_bytes)} -> {disk_size(self.size_after_bytes)}"
        sizes += f" ({self.size_after_bytes / self.size_before_bytes:.2f}x)"
        if self.linear_weights_stored_ratio is not None:
            sizes += f"; pruned Linear weights stored at {self.linear_weights_stored_ratio:.3f}x their dense size"
        rows = [
            ("pattern", f"{self.pattern}, {self.achieved_sparsity:.1%} removed in {self.layers_pruned} layers"),
            ("parameters", f"{self.parameters_before:,} -> {self.parameters_after:,}"),
            ("size on disk", sizes),
            ("time", f"{seconds(self.prune_seconds)} prune"),
        ]
        if self.finetune_steps:
            how = f"distilled from {self.teacher}" if self.teacher else "fine-tuned"
            rows.append(
                ("recovery", f"{how}, {self.finetune_steps} steps, {seconds(self.finetune_seconds)}, "
                 f"final loss {self.finetune_loss:.4f}")
            )  # fmt: skip
        if self.perplexity_before is not None:
            line = f"{self.perplexity_before:.3f} dense -> {self.perplexity_pruned:.3f} pruned"
            if self.perplexity_after is not None and self.finetune_steps:
                line += f" -> {self.perplexity_after:.3f} recovered"
            rows.append(("perplexity", f"{line} on {self.evaluation_text}"))
        return key_value_table(f"pruned {self.model} -> {self.output}", rows)


def run(args: argparse.Namespace) -> int:
    from quantlab.prune import parse_pattern
    from quantlab.prune.patterns import check_sparsity, resolve_sparsity

    console = Console.from_args(args)
    resolve_training_flags(args, "prune")
    pattern = parse_pattern(args.pattern)
    if pattern.kind == "structured":
        sparsity = check_sparsity(args.sparsity if args.sparsity is not None else 0.0, "--sparsity")
        check_sparsity(args.head_sparsity, "--head-sparsity")
        if sparsity == 0 and args.head_sparsity == 0:
            raise QuantlabError("structured pruning needs --sparsity (MLP neurons) and/or --head-sparsity (heads)")
    else:
        sparsity = resolve_sparsity(pattern, args.sparsity)
        if args.head_sparsity:
            raise QuantlabError("--head-sparsity applies to --pattern structured only")
    check_training_values(args, steps_required=False)
    if args.distill_from and not args.max_steps:
        raise QuantlabError("--distill-from trains the pruned model from a teacher: give --max-steps N too")
    distillation = distillation_config(args) if args.distill_from else None
    output = Path(args.output_dir).expanduser()
    text = read_text(args, seq_len=args.eval_seq_len, windows=args.eval_windows) if args.eval else None
    if args.model is None:
        console.note("using the embedded SmolLM2-135M-Instruct (converted into the cache on first use)")
    source = resolve_model(args.model)
    teacher = resolve_model(args.distill_from) if args.distill_from else None
    prepare_run_folder(output, args, [source.path, *([teacher.path] if teacher else []), *data_inputs(args)])
    with float_checkpoint(source, scratch=output.parent, progress=console.progress) as folder:
        report = prune_checkpoint(args, source, folder, pattern, sparsity, output, teacher, distillation, text, console)
    console.report(report.as_table(), {"command": "prune", **dataclasses.asdict(report)})
    return 0


def prune_checkpoint(
    args: argparse.Namespace,
    source: ModelSource,
    folder: Path,
    pattern: Any,
    sparsity: float,
    output: Path,
    teacher_source: ModelSource | None,
    distillation: Any,
    text: TextSpec | None,
    console: Console,
) -> PruneReport:
    if is_quantized(folder):
        raise QuantlabError(f"{source} is quantized; prune its float original, then quantize the pruned model")
    tokenizer = load_tokenizer(folder)
    if (text is not None or args.max_steps) and tokenizer is None:
        raise QuantlabError(f"{source} has no tokenizer, which --eval and --max-steps need")
    model = load_checkpoint(folder)
    parameters_before = sum(p.numel() for p in model.parameters())
    report_eval: dict[str, Any] = {}
    if text is not None:
        console.note(f"measuring perplexity on {text.describe()}")
        report_eval["perplexity_before"] = measure_perplexity(model, tokenizer, text, console)
    console.note(f"pruning {source}: {pattern}")
    started = time.perf_counter()
    achieved, layers = _prune(model, pattern, sparsity, args, tokenizer)
    report = PruneReport(
        model=str(source), output=str(output / FINAL_DIR),
        pattern=str(pattern), sparsity=sparsity, achieved_sparsity=achieved,
        layers_pruned=layers, parameters_before=parameters_before,
        parameters_after=sum(p.numel() for p in model.parameters()), size_before_bytes=weights_size(source.path),
        size_after_bytes=0, prune_seconds=time.perf_counter() - started,
        head_sparsity=args.head_sparsity if pattern.kind == "structured" else None, **report_eval,
    )  # fmt: skip
    if text is not None:
        report.perplexity_pruned = measure_perplexity(model, tokenizer, text, console)
        report.evaluation_text = text.describe()
    if args.max_steps:
        _recover(args, model, tokenizer, teacher_source, distillation, output, report, console)
        if text is not None:
            report.perplexity_after = measure_perplexity(model, tokenizer, text, console)
    inputs = [source.path, *([teacher_source.path] if teacher_source else [])]
    save_model(model, tokenizer, output / FINAL_DIR, protect=inputs)
    report.size_after_bytes = weights_size(output / FINAL_DIR)
    if pattern.kind != "structured":
        from quantlab.prune import sparse_storage

        report.linear_weights_stored_ratio = sparse_storage(output / FINAL_DIR).ratio()
    write_report(output, dataclasses.asdict(report))
    return report


def _prune(model: Any, pattern: Any, sparsity: float, args: argparse.Namespace, tokenizer: Any) -> tuple[float, int]:
    """Prune in place; returns the fraction removed and the number of layers pruned."""
    from quantlab.prune import prune, prune_structured

    if pattern.kind != "structured":
        result = prune(model, pattern, sparsity, scope=args.scope)
        return result.achieved_sparsity, len(result.layers)
    calibration = _calibration_batches(args, tokenizer) if args.calibration_samples > 0 else None
    result = prune_structured(model, mlp_sparsity=sparsity, head_sparsity=args.head_sparsity, calibration=calibration)
    return result.neuron_sparsity, model.config.num_hidden_layers


def _calibration_batches(args: argparse.Namespace, tokenizer: Any) -> list[dict[str, Any]]:
    """The first training examples (never the evaluation windows), one per batch."""
    if tokenizer is None:
        return None
    examples = training_data(args, tokenizer).train
    count = min(args.calibration_samples, len(examples))
    return [{"input_ids": examples[i]["input_ids"].unsqueeze(0)} for i in range(count)]


def _recover(
    args: argparse.Namespace,
    model: Any,
    tokenizer: Any,
    teacher_source: ModelSource | None,
    distillation: Any,
    output: Path,
    report: PruneReport,
    console: Console,
) -> None:
    from quantlab.distill import DistillationTrainer
    from quantlab.prune import KeepMasks, masked_layers
    from quantlab.training import CausalLMCollator, Trainer

    data = training_data(args, tokenizer)
    model.train()
    freeze_embeddings(model)
    started = time.perf_counter()
    windows = eval_windows(args, data)
    training_args = training_arguments(args, console, eval_steps=args.eval_steps if windows is not None else 0)
    options = {"eval_windows": windows, "data_collator": CausalLMCollator.for_tokenizer(tokenizer), "save_final": False}
    if teacher_source is None:
        callbacks = [KeepMasks()] if masked_layers(model) else []
        trainer = Trainer(model, training_args, data.train, callbacks=callbacks, **options)
    else:
        with float_checkpoint(teacher_source, scratch=output.parent, progress=console.progress) as teacher_dir:
            teacher = load_checkpoint(teacher_dir)
            teacher_tokenizer = load_tokenizer(teacher_dir)
        console.note(f"distilling from {teacher_source} for {args.max_steps} steps")
        trainer = DistillationTrainer(
            model, teacher, training_args, data.train, distillation=distillation,
            teacher_tokenizer=teacher_tokenizer, student_tokenizer=tokenizer, **options,
        )  # fmt: skip
        report.teacher = str(teacher_source)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    model.eval()
    report.finetune_steps = args.max_steps
    report.finetune_loss = last_loss(output)
    report.finetune_seconds = time.perf_counter() - started
