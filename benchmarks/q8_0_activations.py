"""SmolLM2 in quantlab's int8 g32 (llama.cpp's Q8_0 grid), scored with float activations and with each
quantized layer's input rounded as llama.cpp's CPU Q8_0 product rounds it (blocks of 32, int8, float16
scale): the second is what llama.cpp computes from the same exported codes.

    python benchmarks/q8_0_activations.py

Perplexity on the harness's 16 x 512 windows; deterministic, one run.
"""

import math
import statistics

import torch
from _common import default_text_path
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantlab
from quantlab.assets.models import smollm2_dir
from quantlab.assets.text import read_text
from quantlab.eval.perplexity import token_ids, window_losses

BLOCK = 32


def round_as_q8_0(x: torch.Tensor) -> torch.Tensor:
    """`x` with each block of 32 along the last dimension rounded to int8 under a float16 absmax scale."""
    blocks = x.reshape(-1, BLOCK)
    scale = (blocks.abs().amax(dim=1, keepdim=True) / 127).to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(blocks / safe).clamp(-127, 127) * scale).reshape(x.shape)


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    windows = torch.tensor(token_ids(tokenizer, read_text(default_text_path()))[: 16 * 512]).view(16, 512)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    config = quantlab.Int8SymmetricConfig(group_size=BLOCK, scale_dtype="float16", embedding_bits=8)
    quantlab.quantize(model, config, progress=False)
    print(f"float activations: {math.exp(statistics.mean(window_losses(model, windows))):.3f}", flush=True)
    layers = [m for name, m in model.named_modules() if name.endswith("proj") or name == "lm_head"]
    for layer in layers:
        layer.register_forward_pre_hook(lambda module, args: (round_as_q8_0(args[0]), *args[1:]))
    rounded = math.exp(statistics.mean(window_losses(model, windows)))
    print(f"activations rounded as Q8_0 in {len(layers)} layers: {rounded:.3f}")


if __name__ == "__main__":
    main()
