"""`quantlab prune [MODEL] --pattern P [--sparsity S] --output DIR`: prune, optionally recover, save.

- `unstructured` / `N:M` (`2:4`, `4:8`): magnitude pruning of every Linear layer but the
  output head; the checkpoint stores the sparse weights compactly (`quantlab.prune.storage`),
  and `quantlab.prune.load_sparse(DIR)` reloads it with its masks.
- `structured`: `--sparsity` of every layer's MLP neurons (and `--head-sparsity` of its
  attention heads) are removed, the matrices shrink, and the checkpoint is an ordinary smaller
  model that `from_pretrained` loads as is. Neurons are scored on `--calibration-samples`
  training examples (0: by weight norms).

`--finetune-steps N` then trains the pruned model on the shared loop, with its masks held;
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
    add_training_arguments,
    check_training_arguments,
    distillation_config,
    freeze_embeddings,
    is_quantized,
    load_checkpoint,
    run_directory,
    save_model,
    training_config,
    training_data,
)
from quantlab.cli.evaluation import TextSpec, add_eval_arguments, measure_perplexity, read_text
from quantlab.cli.models import (
    ModelSource,
    add_model_argument,
    float_checkpoint,
    load_tokenizer,
    resolve_model,
    train_run,
    weights_size,
)
from quantlab.cli.output import add_output_dir_arguments, check_output, write_report
from quantlab.errors import QuantlabError


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
    add_output_dir_arguments(parser)
    parser.add_argument("--finetune-steps", type=int, default=0, metavar="N", help="recovery training steps")
    parser.add_argument(
        "--distill-from", metavar="TEACHER", help="recover by distillation from this model (needs --finetune-steps)"
    )
    add_distillation_arguments(parser)
    add_training_arguments(parser, learning_rate=5e-5)
    add_eval_arguments(parser, help="measure perplexity before and after")
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
    if args.finetune_steps < 0:
        raise QuantlabError("--finetune-steps must be >= 0")
    if args.distill_from and not args.finetune_steps:
        raise QuantlabError("--distill-from trains the pruned model from a teacher: give --finetune-steps N too")
    check_training_arguments(args)
    distillation = distillation_config(args) if args.distill_from else None
    output = Path(args.output).expanduser()
    text = read_text(args) if args.eval else None
    if args.model is None:
        console.note("using the embedded SmolLM2-135M-Instruct (converted into the cache on first use)")
    source = resolve_model(args.model)
    teacher = resolve_model(args.distill_from) if args.distill_from else None
    check_output(output, args.overwrite, source.path, *([teacher.path] if teacher else []))
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
    if (text is not None or args.finetune_steps) and tokenizer is None:
        raise QuantlabError(f"{source} has no tokenizer, which --eval and --finetune-steps need")
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
        model=str(source), output=str(output), pattern=str(pattern), sparsity=sparsity, achieved_sparsity=achieved,
        layers_pruned=layers, parameters_before=parameters_before,
        parameters_after=sum(p.numel() for p in model.parameters()), size_before_bytes=weights_size(source.path),
        size_after_bytes=0, prune_seconds=time.perf_counter() - started,
        head_sparsity=args.head_sparsity if pattern.kind == "structured" else None, **report_eval,
    )  # fmt: skip
    if text is not None:
        report.perplexity_pruned = measure_perplexity(model, tokenizer, text, console)
        report.evaluation_text = text.describe()
    if args.finetune_steps:
        _recover(args, model, tokenizer, teacher_source, distillation, output, report, console)
        if text is not None:
            report.perplexity_after = measure_perplexity(model, tokenizer, text, console)
    inputs = [source.path, *([teacher_source.path] if teacher_source else [])]
    save_model(model, tokenizer, output, args.overwrite, protect=inputs)
    report.size_after_bytes = weights_size(output)
    if pattern.kind != "structured":
        from quantlab.prune import sparse_storage

        report.linear_weights_stored_ratio = sparse_storage(output).ratio()
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
    from quantlab.distill import distillation_trainer
    from quantlab.prune import KeepMasks, masked_layers
    from quantlab.training import CausalLMCollator, Trainer

    data = training_data(args, tokenizer)
    collator = CausalLMCollator.for_tokenizer(tokenizer)
    model.train()
    freeze_embeddings(model)
    started = time.perf_counter()
    with run_directory(args, output) as run_dir:
        config = training_config(args, args.finetune_steps, run_dir)
        if teacher_source is None:
            callbacks = [KeepMasks()] if masked_layers(model) else []
            trainer = Trainer(model, config, data.train, collator=collator, callbacks=callbacks)
        else:
            with float_checkpoint(teacher_source, scratch=output.parent, progress=console.progress) as teacher_dir:
                teacher = load_checkpoint(teacher_dir)
                teacher_tokenizer = load_tokenizer(teacher_dir)
            console.note(f"distilling from {teacher_source} for {args.finetune_steps} steps")
            trainer = distillation_trainer(
                model, teacher, config, data.train, distillation=distillation, collator=collator,
                teacher_tokenizer=teacher_tokenizer, student_tokenizer=tokenizer,
            )  # fmt: skip
            report.teacher = str(teacher_source)
        result = train_run(trainer)
    model.eval()
    report.finetune_steps = args.finetune_steps
    report.finetune_loss = result.loss
    report.finetune_seconds = time.perf_counter() - started
