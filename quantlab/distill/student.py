"""Getting a student ready to learn, and back to a plain model afterwards.

Its weights train directly (all but the embeddings and output head), or LoRA adapters train on
it (required when it is quantized) and are merged into it at the end: re-quantized with its
own method if it is quantized, and pruned back to its masks if it is sparse.
"""

from typing import Any

from torch import nn

from quantlab.distill.trainer import DistillationTrainer
from quantlab.errors import QuantlabError
from quantlab.loading import quantization_method_of
from quantlab.prune.layer_masks import attach_mask, mask_of, masked_layers
from quantlab.training.data import CausalLMCollator
from quantlab.training.lora import add_lora
from quantlab.training.merge import merge_to_float, merge_to_quantized


def freeze_embeddings(model: nn.Module) -> None:
    """Train the decoder layers only: the (often tied) embeddings and output head stay as they are."""
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            module.requires_grad_(False)


def trainable_student(student: nn.Module, lora_r: int | None = None, quantized: bool = False) -> nn.Module:
    """`student` in train mode with its embeddings frozen, or wrapped in LoRA adapters of rank `lora_r`."""
    from peft import prepare_model_for_kbit_training  # PEFT is imported when it is used, not with quantlab.distill

    student.train()
    if lora_r is None:
        freeze_embeddings(student)
        return student
    if quantized:
        prepare_model_for_kbit_training(student, use_gradient_checkpointing=False)  # Trainer turns checkpointing on
    return add_lora(student, r=lora_r, alpha=2 * lora_r, dropout=0.0)


def finished_student(trained: Any, quantized: bool = False) -> nn.Module:
    """The plain student in eval mode: LoRA merged (re-quantized if the base is), pruning masks re-applied."""
    if not hasattr(trained, "merge_and_unload"):  # no adapters
        return trained.eval()
    masks = {name: mask_of(layer) for name, layer in masked_layers(trained).items()}
    merged = merge_to_quantized(trained) if quantized else merge_to_float(trained)
    modules = dict(merged.named_modules())
    for name, mask in masks.items():  # the dense LoRA update is pruned back to the student's pattern
        attach_mask(modules[name.removeprefix("base_model.model.").removesuffix(".base_layer")], mask)
    return merged.eval()


def check_student(config: Any, lora_r: int | None) -> bool:
    """Whether the student (`config`) is quantized; a quantized one must train LoRA adapters (`lora_r`)."""
    quantized = quantization_method_of(config) is not None
    if quantized and lora_r is None:
        raise QuantlabError(
            "the student is quantized: its weights cannot train directly; give it LoRA adapters (lora_r, the CLI's "
            "--lora-r R), merged into it at the end"
        )
    return quantized


def distill(
    student: nn.Module,
    teacher: nn.Module,
    args: Any,
    train: Any,
    tokenizer: Any,
    *,
    lora_r: int | None = None,
    distillation: Any = None,
    eval_windows: Any = None,
    teacher_tokenizer: Any = None,
    resume_from_checkpoint: str | None = None,
) -> tuple[nn.Module, list[float]]:
    """Distill `teacher` into `student` for `args.max_steps` (its weights, or LoRA adapters of rank `lora_r`, which a
    quantized student needs, merged at the end); returns the finished student and the logged losses."""
    quantized = check_student(getattr(student, "config", None), lora_r)
    trainable = trainable_student(student, lora_r, quantized)
    trainer = DistillationTrainer(
        trainable, teacher, args, train, distillation=distillation, eval_windows=eval_windows, save_final=False,
        data_collator=CausalLMCollator.for_tokenizer(tokenizer), teacher_tokenizer=teacher_tokenizer,
        student_tokenizer=tokenizer,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    losses = [record["loss"] for record in trainer.state.log_history if "loss" in record]
    return finished_student(trainable, quantized), losses
