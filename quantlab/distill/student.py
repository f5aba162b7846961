"""Getting a student ready to learn, and back to a plain model afterwards.

Its weights train directly (all but the embeddings and output head), or LoRA adapters train on
it (required when it is quantized) and are merged into it at the end: re-quantized with its
own method if it is quantized, and pruned back to its masks if it is sparse.
"""

from typing import Any

from torch import nn


def freeze_embeddings(model: nn.Module) -> None:
    """Train the decoder layers only: the (often tied) embeddings and output head stay as they are."""
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            module.requires_grad_(False)


def trainable_student(student: nn.Module, lora_r: int | None = None, quantized: bool = False) -> nn.Module:
    """`student` in train mode with its embeddings frozen, or wrapped in LoRA adapters of rank `lora_r`."""
    from peft import prepare_model_for_kbit_training

    from quantlab.training import add_lora

    student.train()
    if lora_r is None:
        freeze_embeddings(student)
        return student
    if quantized:
        prepare_model_for_kbit_training(student, use_gradient_checkpointing=False)  # Trainer turns checkpointing on
    return add_lora(student, r=lora_r, alpha=2 * lora_r, dropout=0.0)


def finished_student(trained: Any, quantized: bool = False) -> nn.Module:
    """The plain student in eval mode: LoRA merged (re-quantized if the base is), pruning masks re-applied."""
    from quantlab.prune import attach_mask, mask_of, masked_layers
    from quantlab.training import merge_to_float, merge_to_quantized

    if not hasattr(trained, "merge_and_unload"):  # no adapters
        return trained.eval()
    masks = {name: mask_of(layer) for name, layer in masked_layers(trained).items()}
    merged = merge_to_quantized(trained) if quantized else merge_to_float(trained)
    modules = dict(merged.named_modules())
    for name, mask in masks.items():  # the dense LoRA update is pruned back to the student's pattern
        attach_mask(modules[name.removeprefix("base_model.model.").removesuffix(".base_layer")], mask)
    return merged.eval()
