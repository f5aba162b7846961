"""The shared training loop (QLoRA, full fine-tuning, and the base of pruning and distillation).

from quantlab.training import Trainer, TrainingConfig, add_lora, bundled_data, prepare_for_kbit_training

model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantlab.NF4Config())
model = add_lora(prepare_for_kbit_training(model), r=16)
data = bundled_data(tokenizer, seq_len=256)
Trainer(model, TrainingConfig("runs/qlora", max_steps=50), data.train,
        eval_windows=data.eval_windows, collator=CausalLMCollator.for_tokenizer(tokenizer)).train()
"""

from quantlab.training.callbacks import Callback, EmptyCacheEvery, ProfilerWindow
from quantlab.training.checkpoint import ResumeError, TrainerState, latest_checkpoint, list_checkpoints
from quantlab.training.config import TrainingConfig
from quantlab.training.data import (
    CausalLMCollator,
    CausalLMData,
    ShardedBatches,
    TokenSequences,
    bundled_data,
    causal_lm_data,
    read_documents,
)
from quantlab.training.evaluation import heldout_perplexity
from quantlab.training.kbit import enable_activation_checkpointing, prepare_for_kbit_training
from quantlab.training.lora import add_lora, linear_layers, load_adapter, resolve_target_modules, save_adapter
from quantlab.training.loss import CausalLMLoss, LossFunction, LossOutput, predicted_tokens
from quantlab.training.merge import MergeReport, merge_adapter, merge_to_float, merge_to_quantized
from quantlab.training.optimizers import (
    UnknownOptimizerError,
    build_optimizer,
    build_scheduler,
    optimizer_names,
    optimizer_state_bytes,
)
from quantlab.training.trainer import PrecisionError, Trainer, TrainResult, make_accelerator

__all__ = [
    "Callback",
    "CausalLMCollator",
    "CausalLMData",
    "CausalLMLoss",
    "EmptyCacheEvery",
    "LossFunction",
    "LossOutput",
    "MergeReport",
    "PrecisionError",
    "ProfilerWindow",
    "ResumeError",
    "ShardedBatches",
    "TokenSequences",
    "TrainResult",
    "Trainer",
    "TrainerState",
    "TrainingConfig",
    "UnknownOptimizerError",
    "add_lora",
    "build_optimizer",
    "build_scheduler",
    "bundled_data",
    "causal_lm_data",
    "enable_activation_checkpointing",
    "heldout_perplexity",
    "latest_checkpoint",
    "linear_layers",
    "list_checkpoints",
    "load_adapter",
    "make_accelerator",
    "merge_adapter",
    "merge_to_float",
    "merge_to_quantized",
    "optimizer_names",
    "optimizer_state_bytes",
    "predicted_tokens",
    "prepare_for_kbit_training",
    "read_documents",
    "resolve_target_modules",
    "save_adapter",
]
