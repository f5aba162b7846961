"""Quantization-aware training with distillation: a calibrated checkpoint trained against its float model.

The start is a quantized checkpoint (GPTQ's, say), or a float model quantized first with a given
config into `output_dir/start`. Its quantized Linear layers train as fake quantizers on their own
storage formats (`quantlab.qat`) against the KL divergence from the float teacher (`teacher`, by
default the float model the quantized checkpoint's `quantlab_report.json` records) on transformers'
Trainer, then are written back as ordinary codes: `output_dir/final` is a checkpoint of the same
format and size that `from_pretrained` reloads. The run folder holds the log, checkpoints and report.

Training text, evaluation and saving: the teacher-student run `quantlab.workflows.teacher_student` (shared
with `quantlab distill`). An encoder (a sentence-embedding model: no language-modelling head) trains the same
way against the cosine distance of its last hidden states (`quantlab.distill.EncoderDistillationLoss`).
"""

import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantlab.config import QuantlabConfig
from quantlab.errors import QuantlabError
from quantlab.loading import ModelSource, open_model, resolve_model, weights_size
from quantlab.training import FINAL_DIR
from quantlab.utils.atomic import atomic_file
from quantlab.workflows.notes import DEFAULT_MODEL_NOTE, Notify, notifier
from quantlab.workflows.outputs import REPORT_FILE, write_report
from quantlab.workflows.runs import TrainingRun, TrainingRunError
from quantlab.workflows.stats import peak_memory_bytes
from quantlab.workflows.teacher_student import TrainingInputs, train_against_teacher
from quantlab.workflows.text import EvaluationText

START_CONFIG = "start_config.json"  # inside the run folder: the options the start was quantized with
START_DIR = "start"  # inside the run folder: the float model quantized with the given config, trained from


@dataclass
class QATReport:
    """What a quantization-aware training run did, as saved in the run folder's `quantlab_report.json`."""

    command: str
    model: str
    teacher: str
    output: str
    method: str
    quantized_first: bool
    layers_trained: int
    layers_from_float_weights: int
    trained: str
    teacher_weights: str
    predicted_peak_memory_bytes: int
    steps: int
    learning_rate: float
    max_offset: float | None
    learn_scales: bool
    scale_lr_ratio: float
    norm_lr_ratio: float | None
    embedding_lr_ratio: float | None
    alpha: float
    temperature: float
    embedding_weight: float
    loss_first: float | None
    loss_last: float | None
    train_seconds: float
    step_seconds_median: float | None
    peak_memory_bytes: int
    size_bytes: int
    bits_per_quantized_weight: float
    perplexity_teacher: float | None
    perplexity_before: float | None
    perplexity_after: float | None
    embedding_cosine_before: float | None
    embedding_cosine_after: float | None
    evaluation_text: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def qat_model(
    model: "str | os.PathLike | ModelSource | None",
    run: TrainingRun,
    *,
    teacher: "str | os.PathLike | ModelSource | None" = None,
    config: QuantlabConfig | None = None,
    options: Any = None,
    distillation: Any = None,
    evaluate: EvaluationText | None = None,
    teacher_weights: str = "float32",
    progress: bool = False,
    notify: Notify | None = None,
) -> QATReport:
    """Train the quantized `model` (or the float `model` quantized with `config` first) for `run.max_steps`
    steps against the float `teacher`, and save it to `run.output_dir/final`.

    `options`: a `quantlab.qat.QATOptions`; `distillation`: a `DistillationConfig` (default: the KL term
    alone at temperature 1). `evaluate`: the teacher's and the student's perplexity before and after.
    `teacher_weights`: the dtype the teacher's Linear weights are held in ("bfloat16" halves its memory;
    it computes in float32 either way: `quantlab.distill.teacher`).
    """
    from quantlab.distill import DistillationConfig
    from quantlab.distill.teacher import HELD_DTYPES
    from quantlab.qat import QATOptions

    note = notifier(notify)
    run.validate(steps_required=True)
    if teacher_weights not in HELD_DTYPES:
        raise QuantlabError(f"teacher_weights={teacher_weights!r} is not valid; use one of {', '.join(HELD_DTYPES)}")
    options = options if options is not None else QATOptions()
    distillation = distillation if distillation is not None else DistillationConfig(alpha=1.0, temperature=1.0)
    if model is None:
        note(DEFAULT_MODEL_NOTE)
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    quantization = _check_start(source, config, distillation)
    teacher_source = _teacher_source(source, teacher, quantization)
    run.prepare([source.path, teacher_source.path])
    student_source = source
    if config is not None:
        student_source = _quantized_start(source, config, run, progress, note)
    scratch = run.output_dir.parent
    with (
        open_model(teacher_source, scratch=scratch, progress=progress) as opened_teacher,
        open_model(student_source, scratch=scratch, progress=progress) as opened_student,
    ):
        opened_teacher.refuse_quantized("the teacher must be the float model; pass its float original as --teacher")
        report = _train(opened_teacher, opened_student, run, options, distillation, evaluate, teacher_weights,
                        progress, note)  # fmt: skip
    report.model, report.quantized_first = str(source), config is not None
    write_report(run.output_dir, report.as_dict())
    return report


def _check_start(source: ModelSource, config: QuantlabConfig | None, distillation: Any) -> str | None:
    """The checkpoint's quantization method; a float model needs `config`, a quantized one must not get it,
    an encoder takes no next-token loss settings."""
    from quantlab.distill.loss import check_encoder_distillation

    with open_model(source) as opened:
        quantization = opened.quantization
        if not opened.is_causal_lm:
            check_encoder_distillation(opened.model_class.__name__, distillation)
    if quantization is None and config is None:
        raise QuantlabError(
            f"{source} is a float model; give --method NAME and its options (e.g. --method custom_bits --bits 3 "
            f"--symmetric --solver gptq) to quantize it first, or pass a quantized checkpoint"
        )
    if quantization is not None and config is not None:
        raise QuantlabError(
            f"{source} is already quantized ({quantization}); drop --method to train it as it is, or pass its "
            f"float model to quantize it with other settings"
        )
    return quantization


def _teacher_source(source: ModelSource, teacher: Any, quantization: str | None) -> ModelSource:
    """`teacher`; else the float model itself, or the float model a quantized checkpoint's report records."""
    if teacher is not None:
        return teacher if isinstance(teacher, ModelSource) else resolve_model(teacher)
    if quantization is None:
        return source
    report = source.folder / REPORT_FILE
    recorded = None
    if report.is_file():
        try:
            recorded = json.loads(report.read_text(encoding="utf-8")).get("model_path")
        except (OSError, ValueError, AttributeError):
            recorded = None
    if not recorded:
        raise QuantlabError(f"{source} records no float model ({REPORT_FILE}); pass --teacher FLOAT_MODEL")
    if not Path(recorded).exists():
        raise QuantlabError(
            f"{source} was quantized from {recorded}, which no longer exists; pass --teacher FLOAT_MODEL"
        )
    return resolve_model(recorded)


def _quantized_start(
    source: ModelSource, config: QuantlabConfig, run: TrainingRun, progress: bool, note: Notify
) -> ModelSource:
    """The float model quantized with `config` into the run folder (kept there, so a resumed run reuses it,
    and refuses to when it was quantized with other options)."""
    from quantlab.training.checkpoints import as_json_values
    from quantlab.workflows.quantize import quantize_to_checkpoint

    start, requested = run.output_dir / START_DIR, as_json_values(config.to_dict())
    if run.resume_from_checkpoint and (start / "config.json").is_file():
        _check_same_start(run.output_dir, requested)
        note(f"reusing the quantized start {start}")
        return resolve_model(start)
    note(f"quantizing {source} with {config!r} into {start}")
    quantize_to_checkpoint(source, config, start, overwrite=True, progress=progress, notify=note)
    with atomic_file(run.output_dir / START_CONFIG) as staging:
        staging.write_text(json.dumps(requested, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return resolve_model(start)


def _check_same_start(output: Path, requested: dict[str, Any]) -> None:
    """Refuse to resume a run whose quantized start was made with other options than `requested`."""
    try:
        saved = json.loads((output / START_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TrainingRunError(
            f"{output / START_CONFIG} is missing or unreadable ({type(error).__name__}), so the options of the "
            f"quantized start cannot be checked; rerun with --overwrite instead of --resume-from-checkpoint"
        ) from error
    changed = [
        f"{key} {saved.get(key)!r} -> {requested.get(key)!r}"
        for key in sorted(set(saved) | set(requested))
        if saved.get(key) != requested.get(key)
    ]
    if changed:
        raise TrainingRunError(
            f"the run in {output} started from a quantization with other options ({'; '.join(changed)}); resume "
            f"with the same options, or rerun with --overwrite instead of --resume-from-checkpoint to start over"
        )


def _train(
    opened_teacher: Any,
    opened_student: Any,
    run: TrainingRun,
    options: Any,
    distillation: Any,
    text: EvaluationText | None,
    teacher_weights: str,
    progress: bool,
    note: Notify,
) -> QATReport:
    from quantlab.distill.teacher import HELD_DTYPES, hold_linear_weights_in
    from quantlab.eval.size import stored_bits_per_weight
    from quantlab.qat import train_quantized
    from quantlab.streaming.reader import CheckpointReader

    def hold_teacher(teacher: Any) -> None:
        if teacher_weights != "float32":
            with CheckpointReader(opened_teacher.folder) as reader:
                hold_linear_weights_in(teacher, HELD_DTYPES[teacher_weights], reader)

    def train(inputs: TrainingInputs) -> tuple[Any, Any]:
        result = train_quantized(
            inputs.student,
            inputs.teacher,
            inputs.arguments,
            inputs.examples,
            inputs.tokenizer,
            options=options,
            distillation=distillation,
            eval_windows=inputs.held_out,
            teacher_tokenizer=inputs.teacher_tokenizer,
            resume_from_checkpoint=run.resume_from_checkpoint,
        )
        return inputs.student, result

    outcome = train_against_teacher(opened_teacher, opened_student, run, train, text, progress, note, hold_teacher)
    result, scores = outcome.result, outcome.scores
    output = run.output_dir
    return QATReport(
        command="qat",
        model=str(opened_student.source),
        teacher=str(opened_teacher.source),
        output=str(output / FINAL_DIR),
        method=str(opened_student.quantization),
        quantized_first=False,
        layers_trained=result.layers,
        layers_from_float_weights=result.float_started,
        trained=result.options.train,
        teacher_weights=teacher_weights,
        predicted_peak_memory_bytes=result.predicted_peak.total,
        steps=run.max_steps,
        learning_rate=outcome.training_args.learning_rate,
        max_offset=options.max_offset,
        learn_scales=options.learn_scales,
        scale_lr_ratio=options.scale_lr_ratio,
        norm_lr_ratio=options.norm_lr_ratio,
        embedding_lr_ratio=options.embedding_lr_ratio,
        alpha=distillation.alpha,
        temperature=distillation.temperature,
        embedding_weight=distillation.embedding_weight,
        loss_first=result.losses[0] if result.losses else None,
        loss_last=result.losses[-1] if result.losses else None,
        train_seconds=outcome.train_seconds,
        step_seconds_median=_steady_step_seconds(result.step_seconds),
        peak_memory_bytes=peak_memory_bytes(),
        size_bytes=weights_size(output / FINAL_DIR),
        bits_per_quantized_weight=stored_bits_per_weight(outcome.student),
        perplexity_teacher=scores.perplexity.get("teacher"),
        perplexity_before=scores.perplexity.get("before"),
        perplexity_after=scores.perplexity.get("after"),
        embedding_cosine_before=scores.cosine.get("before"),
        embedding_cosine_after=scores.cosine.get("after"),
        evaluation_text=scores.describe() if text else None,
    )


def _steady_step_seconds(seconds: list[float]) -> float | None:
    """The median step time after the first (which also warms up the allocator and the kernels)."""
    steady = seconds[1:] or seconds
    return statistics.median(steady) if steady else None
