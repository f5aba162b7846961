"""The QLoRA run of `qlora_finetune.py` on several processes: one script, launched by torchrun or accelerate.

    torchrun --nproc_per_node 2 examples/distributed_finetune.py --max-steps 20 --output-dir runs/ddp
    accelerate launch --multi_gpu --num_processes 2 examples/distributed_finetune.py --max-steps 20
    python examples/distributed_finetune.py --max-steps 20          # one process, same code

Each process loads and quantizes its own copy of the base; the `Trainer`'s `Accelerator` reads
the launcher's environment and wraps the model in DistributedDataParallel (NCCL on GPUs, gloo
on CPU). Every process reads its own slice of each global batch (`batch_size` examples per
process), the adapters' gradients are averaged, and the token-weighted loss makes a step on 2
processes x 2 examples equal one step on 1 process x 4 examples. Only the first process
writes the log, the final adapter and the checkpoints' shared files; each process adds its
own RNG state to every checkpoint, so `--resume-from-checkpoint` continues bit-identically with the
same number of processes (a checkpoint records it and refuses another count).

Notes:
- On one CPU, `accelerate launch --cpu --num_processes 2` starts a single process (accelerate
  1.15); use torchrun or `--multi_gpu`, which falls back to gloo without GPUs. Set
  `OMP_NUM_THREADS` so the processes do not oversubscribe the cores.
- FSDP and DeepSpeed come from accelerate's config (`accelerate config`, then `accelerate
  launch --config_file cfg.yaml ...`): the `Trainer` passes everything through accelerate,
  whose `save_state` then writes the sharded model and optimizer itself. Quantized base
  layers hold their weights in buffers, which FSDP does not shard: with FSDP, shard a float
  base (plain LoRA or full fine-tuning) and keep QLoRA on DDP.
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantlab
from quantlab.eval.models import smollm2_dir
from quantlab.training import (
    CausalLMCollator,
    Trainer,
    TrainingConfig,
    add_lora,
    bundled_data,
    prepare_for_kbit_training,
)


def main() -> None:
    parser = argparse.ArgumentParser(description="Distributed QLoRA of SmolLM2-135M (run under torchrun)")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/smollm2-qlora-ddp"))
    parser.add_argument(
        "--per-device-train-batch-size",
        "--batch-size",
        type=int,
        default=2,
        help="examples per process and micro-batch",
    )
    parser.add_argument(
        "--resume-from-checkpoint", nargs="?", const="latest", metavar="latest|DIR",
        help="continue the run in --output-dir from its newest checkpoint (latest), or from DIR",
    )  # fmt: skip
    args = parser.parse_args()

    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantlab.NF4Config(), dtype=torch.float32)
    model = prepare_for_kbit_training(model, activation_checkpointing=True)
    torch.manual_seed(0)  # the same adapter initialization on every process
    model = add_lora(model, r=16, alpha=32, dropout=0.05)

    data = bundled_data(tokenizer, seq_len=256, eval_windows=4)
    config = TrainingConfig(
        args.output_dir,
        max_steps=args.max_steps,
        batch_size=args.per_device_train_batch_size,
        learning_rate=2e-4,
        lr_scheduler="cosine",
        warmup_ratio=0.06,
        eval_every=args.max_steps,
        save_every=10,
        resume_from=args.resume_from_checkpoint,
    )
    trainer = Trainer(
        model, config, data.train, eval_windows=data.eval_windows, collator=CausalLMCollator.for_tokenizer(tokenizer)
    )
    result = trainer.train()
    if trainer.accelerator.is_main_process:
        processes = trainer.accelerator.num_processes
        print(f"{result.steps} steps on {processes} process(es): loss {result.loss:.4f}, ", end="")
        print(f"held-out perplexity {result.eval_perplexity:.3f}, adapter in {result.final_dir}")


if __name__ == "__main__":
    main()
