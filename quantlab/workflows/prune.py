"""Prune a model, optionally recover it by training or distillation, and save it compactly.

- `unstructured` / `N:M` (`2:4`, `4:8`): magnitude pruning of every Linear layer but the
  output head; the checkpoint stores the sparse weights compactly (`quantlab.prune.storage`),
  and `quantlab.prune.load_sparse(final)` reloads it with its masks.
- `structured`: `sparsity` of every layer's MLP neurons (and `head_sparsity` of its attention
  heads) are removed, the matrices shrink, and the checkpoint is an ordinary smaller model that
  `from_pretrained` loads as is. Neurons are scored on `calibration_samples` training examples
  (0: by weight norms).

The model goes to `run.output_dir/final`; the run folder holds the log, checkpoints and report.
`run.max_steps` > 0 then trains the pruned model on transformers' Trainer, with its masks held;
a `teacher` makes that training a distillation from it (the unpruned model, typically), which
recovers more than plain fine-tuning.
"""

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantlab.errors import QuantlabError
from quantlab.loading import ModelSource, open_model, resolve_model, weights_size
from quantlab.training import FINAL_DIR
from quantlab.workflows.notes import DEFAULT_MODEL_NOTE, Notify, notifier
from quantlab.workflows.outputs import write_report
from quantlab.workflows.runs import TrainingRun
from quantlab.workflows.text import EvaluationText, measure_perplexity


@dataclass
class PruneReport:
    """What a pruning run did, as saved in the run folder's `quantlab_report.json`."""

    command: str
    model: str
    output: str
    pattern: str
    sparsity: float
    teacher: str | None
    finetune_steps: int
    parameters_before: int
    achieved_sparsity: float
    layers_pruned: int
    prune_seconds: float
    parameters_after: int
    head_sparsity: float | None
    finetune_loss: float | None = None
    finetune_seconds: float | None = None
    size_before_bytes: int = 0
    size_after_bytes: int = 0
    linear_weights_stored_ratio: float | None = None
    perplexity_before: float | None = None
    perplexity_pruned: float | None = None
    perplexity_after: float | None = None
    evaluation_text: str | None = None

    def as_dict(self) -> dict[str, Any]:
        report = asdict(self)
        if not self.finetune_steps:  # no recovery ran: the report names no loss or time of one
            del report["finetune_loss"], report["finetune_seconds"]
        return report


def prune_model(
    model: "str | os.PathLike | ModelSource | None",
    run: TrainingRun,
    pattern: str,
    sparsity: float | None = None,
    *,
    head_sparsity: float = 0.0,
    scope: str = "layer",
    calibration_samples: int = 8,
    teacher: "str | os.PathLike | ModelSource | None" = None,
    distillation: Any = None,
    evaluate: EvaluationText | None = None,
    progress: bool = False,
    notify: Notify | None = None,
) -> PruneReport:
    """Prune `model` (None: the embedded default) by `pattern`, recover it for `run.max_steps`, save it.

    `teacher`: recover by distillation from this model (`distillation`: its `DistillationConfig`).
    `evaluate`: measure perplexity dense, pruned and (after recovery) recovered.
    """
    from quantlab.prune import parse_pattern
    from quantlab.prune.pipeline import first_examples, pattern_sparsity, prune_by_pattern

    note = notifier(notify)
    run.validate(steps_required=False)
    parsed = parse_pattern(pattern)
    fraction = pattern_sparsity(parsed, sparsity, head_sparsity)
    if teacher is not None and not run.max_steps:
        raise QuantlabError("--distill-from trains the pruned model from a teacher: give --max-steps N too")
    if model is None:
        note(DEFAULT_MODEL_NOTE)
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    teacher_source = None
    if teacher is not None:
        teacher_source = teacher if isinstance(teacher, ModelSource) else resolve_model(teacher)
    inputs = [source.path, *([teacher_source.path] if teacher_source else [])]
    output = run.prepare(inputs)
    with open_model(source, scratch=output.parent, progress=progress) as opened:
        opened.refuse_quantized("prune its float original, then quantize the pruned model")
        tokenizer = opened.tokenizer()
        if (evaluate is not None or run.max_steps) and tokenizer is None:
            raise QuantlabError(f"{source} has no tokenizer, which --eval and --max-steps need")
        pruned = opened.load_checkpoint()
        parameters_before = sum(p.numel() for p in pruned.parameters())
        perplexity = [measure_perplexity(pruned, tokenizer, evaluate, progress)] if evaluate is not None else []
        note(f"pruning {source}: {parsed}")
        started = time.perf_counter()
        calibration = None
        if parsed.kind == "structured" and calibration_samples > 0 and tokenizer is not None:
            calibration = first_examples(run.training_data(tokenizer).train, calibration_samples)
        outcome = prune_by_pattern(
            pruned, parsed, fraction, scope=scope, head_sparsity=head_sparsity, calibration=calibration
        )
        report = PruneReport(
            command="prune",
            model=str(source),
            output=str(output / FINAL_DIR),
            pattern=str(parsed),
            sparsity=fraction,
            teacher=None,
            finetune_steps=0,
            parameters_before=parameters_before,
            achieved_sparsity=outcome.sparsity,
            layers_pruned=outcome.layers,
            prune_seconds=time.perf_counter() - started,
            parameters_after=sum(p.numel() for p in pruned.parameters()),
            head_sparsity=head_sparsity if parsed.kind == "structured" else None,
        )
        if evaluate is not None:
            perplexity.append(measure_perplexity(pruned, tokenizer, evaluate, progress))
        if run.max_steps:
            _recover(run, pruned, tokenizer, teacher_source, distillation, report, progress, note)
            if evaluate is not None:
                perplexity.append(measure_perplexity(pruned, tokenizer, evaluate, progress))
        from quantlab.saving import save_model

        save_model(pruned, tokenizer, output / FINAL_DIR, protect=inputs)
    _measure(report, source, parsed, output, evaluate, perplexity)
    write_report(output, report.as_dict())
    return report


def _recover(
    run: TrainingRun,
    model: Any,
    tokenizer: Any,
    teacher: ModelSource | None,
    distillation: Any,
    report: PruneReport,
    progress: bool,
    note: Notify,
) -> None:
    """Train the pruned model (masks held) for `run.max_steps`, or distill it from `teacher`."""
    from quantlab.distill import recover

    started, data = time.perf_counter(), run.training_data(tokenizer)
    windows = data.eval_windows if run.eval_steps and run.eval_windows else None
    training_args = run.training_arguments(progress, eval_steps=run.eval_steps if windows is not None else 0)
    options: dict[str, Any] = {"eval_windows": windows, "resume_from_checkpoint": run.resume_from_checkpoint}
    if teacher is not None:
        with open_model(teacher, scratch=run.output_dir.parent, progress=progress) as opened:
            options |= {"teacher": opened.load_checkpoint(), "teacher_tokenizer": opened.tokenizer()}
        if distillation is None:
            from quantlab.distill import DistillationConfig

            distillation = DistillationConfig()
        options["distillation"], report.teacher = distillation, str(teacher)
        note(f"distilling from {teacher} for {run.max_steps} steps")
    losses = recover(model, training_args, data.train, tokenizer, **options)
    report.finetune_steps = run.max_steps
    report.finetune_loss = losses[-1] if losses else None
    report.finetune_seconds = time.perf_counter() - started


def _measure(
    report: PruneReport,
    source: ModelSource,
    pattern: Any,
    output: Path,
    text: EvaluationText | None,
    perplexity: list[float],
) -> None:
    """Sizes before and after, how compactly the pruned weights are stored, and the perplexities measured."""
    from quantlab.prune import sparse_storage

    report.size_before_bytes = weights_size(source.path)
    report.size_after_bytes = weights_size(output / FINAL_DIR)
    if pattern.kind != "structured":
        report.linear_weights_stored_ratio = sparse_storage(output / FINAL_DIR).ratio()
    measured = [*perplexity, None, None, None]
    report.perplexity_before, report.perplexity_pruned, report.perplexity_after = measured[:3]
    report.evaluation_text = text.describe() if text is not None else None
