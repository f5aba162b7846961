"""Training quantized models on `transformers.Trainer`: QLoRA, full fine-tuning, pruning and distillation.

from quantlab.training import Trainer, add_lora, bundled_data, training_arguments

model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantlab.NF4Config())
model = add_lora(peft.prepare_model_for_kbit_training(model), r=16)  # PEFT's, knowing quantlab's layers
data = bundled_data(tokenizer, seq_len=256)
args = training_arguments({"output_dir": "runs/qlora", "max_steps": 50, "learning_rate": 2e-4})
Trainer(model, args, data.train, eval_windows=data.eval_windows,
        data_collator=CausalLMCollator.for_tokenizer(tokenizer)).train()
"""

from quantlab.assets.text import read_documents
from quantlab.training.arguments import read_training_arguments_file, training_arguments
from quantlab.training.checkpoints import ResumeError, latest_checkpoint, list_checkpoints, trainable_parameters
from quantlab.training.data import (
    CausalLMCollator,
    CausalLMData,
    TokenSequences,
    bundled_data,
    causal_lm_data,
)
from quantlab.training.evaluation import heldout_perplexity
from quantlab.training.lora import add_lora
from quantlab.training.merge import merge_adapter, merge_to_float, merge_to_quantized

FINAL_DIR = "final"  # where a run's trained model goes, inside output_dir


def __getattr__(name: str):
    """`Trainer` and `read_log` import transformers' Trainer (and with it PEFT and bitsandbytes): only when used."""
    if name in ("Trainer", "read_log"):
        from quantlab.training import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'quantlab.training' has no attribute {name!r}")


__all__ = [
    "FINAL_DIR",
    "CausalLMCollator",
    "CausalLMData",
    "ResumeError",
    "TokenSequences",
    "Trainer",
    "add_lora",
    "bundled_data",
    "causal_lm_data",
    "heldout_perplexity",
    "latest_checkpoint",
    "list_checkpoints",
    "merge_adapter",
    "merge_to_float",
    "merge_to_quantized",
    "read_documents",
    "read_log",
    "read_training_arguments_file",
    "trainable_parameters",
    "training_arguments",
]
