"""Perplexity evaluation speed on SmolLM2: the shared harness (16 windows of 512 tokens) on torch fp32
and on quantized models, side by side in one process, rounds alternated.

    python benchmarks/evaluation.py                 # fp32, 4-bit g64, 4-bit g64 e8, int8, nf4; 3 rounds
    python benchmarks/evaluation.py --methods 4bit --rounds 5

Every window is a 512-row forward pass, so this is the many-row kernels at work (what prompts,
evaluation and QLoRA run on). Prints seconds per evaluation, the speed ratio fp32 / candidate taken
inside each round (> 1: the candidate is faster), the perplexity, and the load average.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantlab import CustomBitsConfig, Int8SymmetricConfig, NF4Config
from quantlab.assets.models import smollm2_dir
from quantlab.assets.text import bundled_text
from quantlab.eval.perplexity import perplexity

sys.path.insert(0, str(Path(__file__).parent))
from kernel_speed import Spread, print_table

METHODS = {
    "4bit": CustomBitsConfig(bits=4, group_size=64),
    "4bit e8": CustomBitsConfig(bits=4, group_size=64, embedding_bits=8),
    "int8": Int8SymmetricConfig(),
    "nf4": NF4Config(),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    directory = smollm2_dir()
    tokenizer, text = AutoTokenizer.from_pretrained(directory), bundled_text()
    models = {"fp32": AutoModelForCausalLM.from_pretrained(directory).eval()}
    for name in args.methods:
        models[name] = AutoModelForCausalLM.from_pretrained(directory, quantization_config=METHODS[name]).eval()
    seconds = {name: Spread() for name in models}
    ratios = {name: Spread() for name in models}
    scores: dict[str, float] = {}
    names = list(models)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        this_round: dict[str, float] = {}
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            scores[name] = perplexity(models[name], tokenizer, text)
            this_round[name] = time.perf_counter() - start
        for name, value in this_round.items():
            seconds[name].values.append(value)
            ratios[name].values.append(this_round["fp32"] / value)
        print(f"  round {round_index + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    title = (
        f"SmolLM2-135M perplexity, 16 x 512 windows, {args.threads} threads, {args.rounds} rounds, "
        f"load average {' '.join(f'{value:.1f}' for value in os.getloadavg())}; median [min-max]"
    )
    rows = [[name, seconds[name].range_text(1), ratios[name].range_text(), f"{scores[name]:.3f}"] for name in names]
    print_table(title, ["candidate", "seconds", "fp32 / candidate", "perplexity"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
