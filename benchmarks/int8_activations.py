"""What `compile_for_decoding(int8_activations=True)` costs in perplexity on SmolLM2: the evaluation
windows (16 x 512 tokens of the bundled text, the shared harness's), teacher-forced through compiled
forwards with quantlab's graph pass, float activations against int8 ones, and the eager model, in
float and with its layers marked for int8 activations as `int8_activations=True` marks them (the
path a prompt's prefill takes: the many-row int8 kernels; the output head stays float there).

    python benchmarks/int8_activations.py                    # 4-bit g64 e8 and int8 e8
    python benchmarks/int8_activations.py --methods "4bit e8"

The int8 kernel rounds each row's activations on their own (per block of 64 inputs), so a 512-row
window computes what 512 one-token decode steps would; transformers compiles only those steps, so
this script compiles the whole forward itself. Times include compiling and are not speed figures.
"""

import argparse
import math
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantlab import CustomBitsConfig, Int8SymmetricConfig
from quantlab.assets.models import smollm2_dir
from quantlab.assets.text import bundled_text
from quantlab.eval.perplexity import token_ids
from quantlab.generation.fusion import FuseProjections, mark_int8_activations
from quantlab.kernels.cpu import native

METHODS = {
    "4bit e8": CustomBitsConfig(bits=4, group_size=64, embedding_bits=8),
    "int8 e8": Int8SymmetricConfig(embedding_bits=8),
}
WINDOWS, SEQ_LEN = 16, 512


def perplexity(forward, windows: torch.Tensor) -> float:
    """The harness's formula: mean negative log-likelihood of every predicted token, exponentiated."""
    total = 0.0
    with torch.no_grad():
        for window in windows:
            logits = forward(window[None])[0].float()
            total += torch.nn.functional.cross_entropy(logits[:-1], window[1:], reduction="sum").item()
    return math.exp(total / (len(windows) * (windows.shape[1] - 1)))


def logits_of(model) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x, use_cache=False).logits

    return forward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = parser.parse_args(argv)
    if not native.int8_activations_supported():
        print("note: this CPU has no AVX2 (or no native kernels): int8 activations compute in float here")
    torch.set_num_threads(2)
    directory = smollm2_dir()
    ids = token_ids(AutoTokenizer.from_pretrained(directory), bundled_text())
    windows = torch.tensor(ids[: WINDOWS * SEQ_LEN]).view(WINDOWS, SEQ_LEN)
    print("| method | eager | compiled, float activations | compiled, int8 activations | eager, int8 activations |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.methods:
        model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=METHODS[name]).eval()

        eager = logits_of(model)
        figures = [perplexity(eager, windows)]
        for activation_bits in (0, 8):
            torch._dynamo.reset()
            graph_pass = FuseProjections(True, activation_bits)
            compiled = torch.compile(eager, options={"post_grad_custom_post_pass": graph_pass})
            started = time.perf_counter()
            figures.append(perplexity(compiled, windows))
            print(
                f"  {name}, activation bits {activation_bits or 32}: {time.perf_counter() - started:.0f} s", flush=True
            )
        mark_int8_activations(model, 8)  # what int8_activations=True does to eager forwards (a prompt's prefill)
        figures.append(perplexity(eager, windows))
        print(f"| {name} | " + " | ".join(f"{value:.3f}" for value in figures) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
