"""One teacher-student run, shared by `quantlab distill` and `quantlab qat`.

Both load a frozen teacher and a student, check that they read the same vocabulary, score the student
before training (perplexity on the evaluation text, with the teacher's beside it; for an encoder the
mean cosine of its sentence embeddings with the teacher's), train it on the run's text, score it
again and save it to `run.output_dir/final`. What differs is the training step itself (`train`): the
distillation trainer, or quantization-aware training of the student's stored codes.

Training text: the run's `data` file, else the bundled WikiText-2 slice after the perplexity
harness's 16 x 512 evaluation tokens (from token 8,192 on), whatever `--eval-windows` says, so no run
trains on the windows it is evaluated on. An encoder trains on one example a line (on the bundled
slice, the lines after the first 256, those encoders are evaluated on).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from quantlab.training import FINAL_DIR
from quantlab.workflows.notes import Notify
from quantlab.workflows.runs import TrainingRun, TrainingRunError
from quantlab.workflows.text import EvaluationText, measure_perplexity


@dataclass
class TrainingInputs:
    """What a training step works on: both models, transformers' `TrainingArguments`, the examples, the held-out
    windows it evaluates on while training (None: none) and both tokenizers."""

    student: nn.Module
    teacher: nn.Module
    arguments: Any
    examples: Any
    held_out: Any
    tokenizer: Any
    teacher_tokenizer: Any


# the training step: → (the trained student, what the step returned)
TrainStep = Callable[[TrainingInputs], tuple[nn.Module, Any]]


@dataclass
class TeacherStudentOutcome:
    """What a teacher-student run did: the saved student, the training step's result, its arguments and time,
    and the scores before and after."""

    student: Any
    result: Any
    training_args: Any
    train_seconds: float
    scores: "Scores"


def train_against_teacher(
    opened_teacher: Any,
    opened_student: Any,
    run: TrainingRun,
    train: TrainStep,
    text: EvaluationText | None,
    progress: bool,
    note: Notify,
    prepare_teacher: Callable[[Any], None] | None = None,
) -> TeacherStudentOutcome:
    """Load both models, score the student, train it with `train`, score it again and save it to
    `run.output_dir/final` (never over either input). `prepare_teacher(teacher)` runs once the teacher is
    loaded (to hold its weights in another dtype, say)."""
    from quantlab.distill import check_vocabularies
    from quantlab.saving import save_model
    from quantlab.utils.model_kind import is_language_model

    teacher_tokenizer, student_tokenizer = opened_teacher.tokenizer(), opened_student.tokenizer()
    tokenizer = student_tokenizer or teacher_tokenizer
    if tokenizer is None:
        raise TrainingRunError("training needs the model's tokenizer, and the model folder has none")
    note(f"loading the teacher {opened_teacher.source} and the student {opened_student.source}")
    teacher, student = opened_teacher.load_checkpoint(), opened_student.load_checkpoint()
    check_vocabularies(teacher, student, teacher_tokenizer, student_tokenizer)
    if prepare_teacher is not None:
        prepare_teacher(teacher)
    language_model = is_language_model(student)
    scores = Scores(teacher, tokenizer, text, language_model, progress)
    if text is not None:
        note(f"measuring {'perplexity' if language_model else 'embedding cosine to the teacher'} on "
             f"{scores.describe()}")  # fmt: skip
        scores.measure("before", student)
    examples, windows = _examples(run, tokenizer, student, language_model)
    training_args = run.training_arguments(progress, eval_steps=run.eval_steps if windows is not None else 0)
    started = time.perf_counter()
    inputs = TrainingInputs(student, teacher, training_args, examples, windows, tokenizer, teacher_tokenizer)
    student, result = train(inputs)
    del inputs
    train_seconds = time.perf_counter() - started
    del teacher
    if text is not None:
        scores.measure("after", student)
    protect = [opened_teacher.folder, opened_student.folder]
    save_model(student, tokenizer, run.output_dir / FINAL_DIR, protect=protect)
    return TeacherStudentOutcome(student, result, training_args, train_seconds, scores)


def _examples(run: TrainingRun, tokenizer: Any, student: Any, language_model: bool) -> tuple[Any, Any]:
    """The training examples and the held-out windows (None unless the run evaluates while it trains)."""
    if language_model:
        data = training_data(run, tokenizer)
        return data.train, data.eval_windows if run.eval_steps and run.eval_windows else None
    from quantlab.eval.embeddings import position_limit
    from quantlab.training.encoder_data import encoder_examples

    length = min(run.max_seq_length, position_limit(student))  # a line is cut to what the encoder reads
    return encoder_examples(tokenizer, run.documents(), length), None


def training_data(run: TrainingRun, tokenizer: Any) -> Any:
    """The run's examples and held-out windows; on the bundled text the examples always start after the
    harness's evaluation tokens (16 x 512), even when the run holds out fewer."""
    from quantlab.calibration.data import EVAL_SEQ_LEN, EVAL_TOKENS, EVAL_WINDOWS
    from quantlab.training import causal_lm_data

    data = run.training_data(tokenizer)
    if run.data is None and run.eval_windows * run.eval_seq_len < EVAL_TOKENS:
        data.train = causal_lm_data(tokenizer, None, run.max_seq_length, EVAL_WINDOWS, EVAL_SEQ_LEN).train
    return data


class Scores:
    """The evaluation of a run: perplexity (a causal LM; the teacher's too) or the mean cosine of the
    sentence embeddings with the teacher's (an encoder), by moment ("teacher", "before", "after")."""

    def __init__(
        self, teacher: Any, tokenizer: Any, text: EvaluationText | None, language_model: bool, progress: bool
    ) -> None:
        self.tokenizer, self.text, self.language_model, self.progress = tokenizer, text, language_model, progress
        self.perplexity: dict[str, float] = {}
        self.cosine: dict[str, float] = {}
        self.lines: list[str] = []
        self.reference = None
        if text is None:
            return
        if language_model:
            self.perplexity["teacher"] = measure_perplexity(teacher, tokenizer, text, progress)
        else:
            from quantlab.eval.embeddings import evaluation_lines, sentence_embeddings

            self.lines = evaluation_lines(text.text)
            self.reference = sentence_embeddings(teacher, tokenizer, self.lines)

    def measure(self, moment: str, student: Any) -> None:
        if self.language_model:
            self.perplexity[moment] = measure_perplexity(student, self.tokenizer, self.text, self.progress)
            return
        from quantlab.eval.embeddings import embedding_cosines, sentence_embeddings

        student.eval()
        embeddings = sentence_embeddings(student, self.tokenizer, self.lines)
        self.cosine[moment] = float(embedding_cosines(embeddings, self.reference).mean())

    def describe(self) -> str:
        if self.language_model or self.text is None:
            return self.text.describe() if self.text is not None else ""
        return f"the first {len(self.lines)} non-empty lines of {self.text.source}"
