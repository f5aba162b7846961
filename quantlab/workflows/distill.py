"""Distill a frozen teacher into a student on transformers' Trainer.

The teacher (float, quantized or sparse checkpoint) runs frozen; the student learns from
`alpha * T^2 * KL + (1 - alpha) * CE` (see `quantlab.distill.DistillationConfig`): all its weights
but the embeddings, or LoRA adapters (`lora_r`, required for a quantized student, merged into it
at the end). A sparse student (written by the prune workflow) keeps its masks and is saved
sparse. The run folder holds the log, checkpoints and report; the student goes to `final/`. Loading,
training text, evaluation and saving: the teacher-student run `quantlab.workflows.teacher_student`
(shared with `quantlab qat`).
"""

import os
from dataclasses import asdict, dataclass
from typing import Any

from quantlab.errors import QuantlabError
from quantlab.loading import ModelSource, open_model, resolve_model, weights_size
from quantlab.training import FINAL_DIR
from quantlab.workflows.notes import Notify, notifier
from quantlab.workflows.outputs import write_report
from quantlab.workflows.runs import TrainingRun
from quantlab.workflows.teacher_student import TrainingInputs, train_against_teacher
from quantlab.workflows.text import EvaluationText


@dataclass
class DistillReport:
    """What a distillation run did, as saved in the run folder's `quantlab_report.json`."""

    command: str
    teacher: str
    student: str
    output: str
    steps: int
    alpha: float
    temperature: float
    hidden_weight: float
    embedding_weight: float
    lora_r: int | None
    loss: float | None
    train_seconds: float
    size_bytes: int
    perplexity_teacher: float | None
    perplexity_before: float | None
    perplexity_after: float | None
    evaluation_text: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def distill_model(
    teacher: "str | os.PathLike | ModelSource",
    student: "str | os.PathLike | ModelSource",
    run: TrainingRun,
    *,
    lora_r: int | None = None,
    distillation: Any = None,
    evaluate: EvaluationText | None = None,
    progress: bool = False,
    notify: Notify | None = None,
) -> DistillReport:
    """Train `student` to match `teacher` for `run.max_steps` steps and save it to `run.output_dir/final`.

    `distillation`: the loss's `DistillationConfig` (default: its defaults). `evaluate`: measure the
    teacher's and the student's perplexity before and after.
    """
    from quantlab.distill import DistillationConfig

    run.validate(steps_required=True)
    distillation = distillation if distillation is not None else DistillationConfig()
    if lora_r is not None and lora_r < 1:
        raise QuantlabError("--lora-r must be at least 1")
    teacher_source = teacher if isinstance(teacher, ModelSource) else resolve_model(teacher)
    student_source = student if isinstance(student, ModelSource) else resolve_model(student)
    run.prepare([teacher_source.path, student_source.path])
    scratch = run.output_dir.parent
    with (
        open_model(teacher_source, scratch=scratch, progress=progress) as opened_teacher,
        open_model(student_source, scratch=scratch, progress=progress) as opened_student,
    ):
        return _distill(opened_teacher, opened_student, run, lora_r, distillation, evaluate, progress, notifier(notify))


def _distill(
    opened_teacher: Any,
    opened_student: Any,
    run: TrainingRun,
    lora_r: int | None,
    distillation: Any,
    text: EvaluationText | None,
    progress: bool,
    note: Notify,
) -> DistillReport:
    from quantlab.distill import check_student, distill

    check_student(opened_student.config, lora_r)
    if not opened_student.is_causal_lm:
        raise QuantlabError(
            f"{opened_student.source} is not a causal LM: distill trains next-token prediction; train an encoder "
            f"against its float model with `quantlab qat`"
        )

    def train(inputs: TrainingInputs) -> tuple[Any, list[float]]:
        return distill(
            inputs.student,
            inputs.teacher,
            inputs.arguments,
            inputs.examples,
            inputs.tokenizer,
            lora_r=lora_r,
            distillation=distillation,
            eval_windows=inputs.held_out,
            teacher_tokenizer=inputs.teacher_tokenizer,
            resume_from_checkpoint=run.resume_from_checkpoint,
        )

    outcome = train_against_teacher(opened_teacher, opened_student, run, train, text, progress, note)
    losses, scores, output = outcome.result, outcome.scores, run.output_dir
    report = DistillReport(
        command="distill",
        teacher=str(opened_teacher.source),
        student=str(opened_student.source),
        output=str(output / FINAL_DIR),
        steps=run.max_steps,
        alpha=distillation.alpha,
        temperature=distillation.temperature,
        hidden_weight=distillation.hidden_weight,
        embedding_weight=distillation.embedding_weight,
        lora_r=lora_r,
        loss=losses[-1] if losses else None,
        train_seconds=outcome.train_seconds,
        size_bytes=weights_size(output / FINAL_DIR),
        perplexity_teacher=scores.perplexity.get("teacher"),
        perplexity_before=scores.perplexity.get("before"),
        perplexity_after=scores.perplexity.get("after"),
        evaluation_text=text.describe() if text else None,
    )
    write_report(output, report.as_dict())
    return report
