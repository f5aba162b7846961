"""SmolLM2-135M greedy decoding on CPU: tokens per second, fp32 against each quantlab method.

    python benchmarks/decode.py                       # 64 new tokens, 5 rounds, 2 threads
    python benchmarks/decode.py --methods int8 4bit --tokens 32 --json

Every model is loaded once (quantized while loading), then all are timed in every round, in
rotated order, so the ratios compare runs seconds apart on a machine shared with others.
Decoding speed excludes the prompt: (tokens - 1) / (time of `tokens` new tokens - time of 1).
The output head stays in fp32 in every model (transformers keeps tied embeddings unquantized),
so it bounds the speed-up: at one token it reads 113 MB, the quantized layers 55-110 MB.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantlab
from quantlab import CustomBitsConfig, Int8SymmetricConfig, NF4Config
from quantlab.eval.data import bundled_text
from quantlab.eval.models import smollm2_dir
from quantlab.kernels.cpu import native

sys.path.insert(0, str(Path(__file__).parent))
from kernels import Spread, print_table

METHODS = {
    "int8": Int8SymmetricConfig(),
    "nf4": NF4Config(),
    "4bit": CustomBitsConfig(bits=4, group_size=64),
    "3bit": CustomBitsConfig(bits=3, group_size=64),
}


def generate_seconds(model, prompt: torch.Tensor, tokens: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return time.perf_counter() - start, out[0, prompt.shape[1] :]


def decode_tokens_per_second(model, prompt: torch.Tensor, tokens: int) -> tuple[float, torch.Tensor]:
    first, _ = generate_seconds(model, prompt, 1)
    total, generated = generate_seconds(model, prompt, tokens)
    return (tokens - 1) / max(total - first, 1e-9), generated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per generation")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()

    directory = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer(bundled_text(), return_tensors="pt").input_ids[:, : args.prompt_tokens]
    models = {"fp32": AutoModelForCausalLM.from_pretrained(directory).eval()}
    for name in args.methods:
        models[name] = AutoModelForCausalLM.from_pretrained(directory, quantization_config=METHODS[name]).eval()
    for model in models.values():
        model.generation_config.pad_token_id = tokenizer.eos_token_id
        generate_seconds(model, prompt, 2)  # warm-up (and the native library's first load)

    speed = {name: Spread() for name in models}
    generated = {}
    names = list(models)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            tokens_per_second, generated[name] = decode_tokens_per_second(models[name], prompt, args.tokens)
            speed[name].values.append(tokens_per_second)
        print(f"  round {round_index + 1}/{args.rounds} done", flush=True)

    print(
        f"\nSmolLM2-135M greedy decoding, {args.prompt_tokens}-token prompt, {args.tokens} new tokens, "
        f"{args.threads} threads, quantlab kernels: {native.isa()}, load average {os.getloadavg()[0]:.1f}"
    )
    rows = []
    for name in names:
        ratio = Spread([a / b for a, b in zip(speed[name].values, speed["fp32"].values, strict=True)])
        same = (generated[name] == generated["fp32"]).float().mean().item()
        stored = sum(m.stored_bytes() for m in quantlab.convert.quantized_layers(models[name]).values())
        rows.append([name, speed[name].range_text(1), ratio.range_text(), f"{same:.0%}", f"{stored / 2**20:.0f}"])
    print_table(
        "Tokens per second, median [min-max] over rounds",
        ["model", "tokens/s", "x fp32", "tokens equal to fp32", "quantized layers MiB"],
        rows,
    )
    if args.json:
        print(json.dumps({name: {"tokens_per_second": speed[name].values} for name in names}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
