"""One quantization-aware training run on a loaded quantized student and its float teacher."""

import dataclasses
from typing import Any

from torch import nn

from quantlab.qat.memory import TrainingMemory, predict_peak, resolve_training
from quantlab.qat.options import QATOptions
from quantlab.qat.swap import dropout_off, fake_quantize, float_linear_weights, write_back
from quantlab.qat.trainer import QATTrainer
from quantlab.training.data import CausalLMCollator
from quantlab.utils.scratch import release_scratch


@dataclasses.dataclass
class QATResult:
    """What the run trained: its logged losses, the layers trained and how many started from float weights,
    and the options it ran with (`train` resolved)."""

    losses: list[float]
    layers: int
    float_started: int
    log: list[dict[str, Any]]
    options: QATOptions
    predicted_peak: TrainingMemory
    step_seconds: list[float]


def train_quantized(
    student: nn.Module,
    teacher: nn.Module,
    args: Any,
    train: Any,
    tokenizer: Any,
    *,
    options: QATOptions | None = None,
    distillation: Any = None,
    eval_windows: Any = None,
    teacher_tokenizer: Any = None,
    resume_from_checkpoint: str | None = None,
) -> QATResult:
    """Train the quantized `student` in place to match the float `teacher` for `args.max_steps` steps.

    Its quantized Linear layers train as fake quantizers starting from their stored codes (the latent
    weights from `teacher`'s weights where names and shapes match), and end as ordinary stored codes and
    grids equal bit for bit to what the fake quantizers computed. The student's dropout is off while it
    trains: it matches the teacher as the teacher runs. An encoder (no language-modelling head) trains
    on its last hidden states (`quantlab.distill.EncoderDistillationLoss`). `args` are `TrainingArguments`;
    `distillation` a `DistillationConfig`. `options.train="auto"` becomes "weights" where that run's
    predicted peak fits the memory available, else "grids" (`quantlab.qat.memory`).
    """
    options = options or QATOptions()
    checkpointing = any(getattr(args, name, False) for name in ("activation_checkpointing", "gradient_checkpointing"))
    shape = (args.per_device_train_batch_size, _longest_example(train), checkpointing)
    options = resolve_training(options, student, teacher, *shape)
    predicted = predict_peak(student, teacher, options.train, *shape, options.embedding_lr_ratio is not None)
    swapped = fake_quantize(student, float_linear_weights(teacher), options)
    student.train()
    try:
        trainer = QATTrainer(
            student, teacher, args, train, swapped=swapped, options=options, distillation=distillation,
            eval_windows=eval_windows, save_final=False, data_collator=CausalLMCollator.for_tokenizer(tokenizer),
            teacher_tokenizer=teacher_tokenizer, student_tokenizer=tokenizer,
        )  # fmt: skip
        with dropout_off(student):
            trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    finally:
        release_scratch()  # the decoding buffers of grid training: a largest layer's worth each
        student.eval()
        write_back(student, swapped)
    log = list(trainer.state.log_history)
    return QATResult(
        losses=[record["loss"] for record in log if "loss" in record],
        layers=len(swapped),
        float_started=sum(layer.float_start for layer in swapped.values()),
        log=log,
        options=options,
        predicted_peak=predicted,
        step_seconds=list(trainer.step_times.seconds),
    )


def _longest_example(train: Any, looked_at: int = 256) -> int:
    """Tokens in the longest of the first examples (what a micro-batch's activations are sized by)."""
    try:
        return max((len(train[i]["input_ids"]) for i in range(min(len(train), looked_at))), default=0)
    except (TypeError, KeyError, IndexError):
        return 0
