"""ONNX export of SmolLM2-135M: file sizes, fidelity and decoding speed, side by side in one process.

    python benchmarks/onnx_export.py                          # 4-bit asymmetric, groups of 64
    python benchmarks/onnx_export.py --workdir onnx-bench --reuse --json report.json

Exports SmolLM2 (fp32) and its quantlab 4-bit model to ONNX with past key values, and
onnxruntime's own `quantize_dynamic` int8 of the fp32 export for comparison. Then:

- sizes of the files (embeddings included; the tied embedding / lm_head stays fp32 and is stored once);
- fidelity on the shared harness's perplexity windows (16 x 512 tokens of WikiText-2): the
  largest |logit| difference between onnxruntime and the PyTorch quantized model, and both
  perplexities;
- greedy generation: 5 prompts x 20 tokens, onnxruntime against PyTorch, token for token;
- decoding speed: tokens/s after the prompt, for onnxruntime 4-bit, onnxruntime fp32,
  onnxruntime dynamic int8, PyTorch fp32 and PyTorch quantlab 4-bit (`generate`, greedy,
  batch 1, 2 threads each). Every engine runs in every round, in rotated order; a figure is
  the median over rounds, ratios are taken within a round.

Ends with the acceptance checks (4-bit file <= 0.35x fp32, logits within 1e-3,
perplexity within 0.05, onnxruntime 4-bit decoding >= 3x PyTorch fp32).
"""

import argparse
import copy
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import default_text_path, environment, format_table, number, write_json
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantlab
from quantlab.assets.models import smollm2_dir
from quantlab.assets.text import read_text
from quantlab.eval import perplexity
from quantlab.eval.perplexity import token_ids
from quantlab.export import OnnxCausalLM, to_onnx
from quantlab.export.onnx.ort_quantize import quantize_dynamic_int8
from quantlab.export.onnx.saving import stored_bytes

PROMPTS = [
    "The capital of France is",
    "Photosynthesis is the process by which",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics state that",
]
GREEDY_TOKENS = 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--symmetric", action="store_true")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32, help="new tokens per timed generation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, help="where the ONNX files go (default: a temporary folder)")
    parser.add_argument("--reuse", action="store_true", help="reuse ONNX files already in --workdir")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    return parser.parse_args()


def export(model, path: Path, reuse: bool) -> float:
    if reuse and path.exists():
        print(f"reusing {path}", file=sys.stderr)
        return float("nan")
    start = time.perf_counter()
    to_onnx(model, path, with_past=True, overwrite=True)
    return time.perf_counter() - start


# -- fidelity ----------------------------------------------------------------------------------


def window_fidelity(torch_model, onnx_model: OnnxCausalLM, windows: torch.Tensor) -> dict[str, float]:
    """Max |logit difference| over all windows, and the perplexity of each side from its own logits."""
    worst, torch_losses, onnx_losses = 0.0, [], []
    for row in windows:
        ids = row.unsqueeze(0)
        with torch.inference_mode():
            reference = torch_model(ids).logits.float()
        exported = onnx_model(ids).float()
        worst = max(worst, float((exported - reference).abs().max()))
        torch_losses.append(_loss(reference, ids))
        onnx_losses.append(_loss(exported, ids))
    return {
        "max_logit_difference": worst,
        "perplexity_torch": math.exp(statistics.fmean(torch_losses)),
        "perplexity_onnx": math.exp(statistics.fmean(onnx_losses)),
    }


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(F.cross_entropy(logits[0, :-1], ids[0, 1:]))


def greedy_matches(torch_model, onnx_model: OnnxCausalLM, tokenizer) -> int:
    matches = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            expected = torch_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS, do_sample=False
            )
        got = onnx_model.generate(ids, max_new_tokens=GREEDY_TOKENS)
        matches += int(torch.equal(got, expected))
    return matches


# -- speed -------------------------------------------------------------------------------------


def torch_generator(model) -> Callable[[torch.Tensor, int], object]:
    def generate(ids: torch.Tensor, tokens: int):
        with torch.inference_mode():
            return model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
            )

    return generate


def onnx_generator(model: OnnxCausalLM) -> Callable[[torch.Tensor, int], object]:
    return lambda ids, tokens: model.generate(ids, max_new_tokens=tokens)


def decode_tokens_per_second(generate, ids: torch.Tensor, tokens: int) -> float:
    """(tokens - 1) / (time of `tokens` new tokens - time of 1): the prompt's cost cancels."""
    start = time.perf_counter()
    generate(ids, 1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    generate(ids, tokens)
    many = time.perf_counter() - start
    return (tokens - 1) / max(many - one, 1e-9)


def measure_speed(engines: dict[str, Callable], ids: torch.Tensor, tokens: int, rounds: int) -> dict[str, list[float]]:
    for generate in engines.values():  # warm-up: first-call allocations, lazy initialisation
        generate(ids, 2)
    results: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for round_index in range(rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            results[name].append(decode_tokens_per_second(engines[name], ids, tokens))
        print(f"round {round_index + 1}: " + ", ".join(f"{n} {results[n][-1]:.1f}" for n in names), file=sys.stderr)
    return results


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    args = parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(args.threads)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="quantlab-onnx-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = quantlab.CustomBitsConfig(bits=args.bits, group_size=args.group_size, symmetric=args.symmetric)
    tag = f"b{args.bits}g{args.group_size}{'s' if args.symmetric else 'a'}"

    directory = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    float_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    quantized_model = quantlab.quantize(copy.deepcopy(float_model), config).eval()

    paths = {"fp32": workdir / "smollm2-fp32.onnx", "q": workdir / f"smollm2-{tag}.onnx"}
    paths["int8"] = workdir / "smollm2-ort-dynamic-int8.onnx"
    export_seconds = {"fp32": export(float_model, paths["fp32"], args.reuse)}
    export_seconds["q"] = export(quantized_model, paths["q"], args.reuse)
    if not (args.reuse and paths["int8"].exists()):
        start = time.perf_counter()
        quantize_dynamic_int8(paths["fp32"], paths["int8"])
        export_seconds["int8"] = time.perf_counter() - start
    sizes = {name: stored_bytes(path) for name, path in paths.items()}

    onnx_q = OnnxCausalLM(paths["q"], threads=args.threads)
    onnx_fp32 = OnnxCausalLM(paths["fp32"], threads=args.threads)
    onnx_int8 = OnnxCausalLM(paths["int8"], threads=args.threads)

    text = read_text(default_text_path())
    ids = torch.tensor(token_ids(tokenizer, text)[: args.windows * args.seq_len]).view(args.windows, args.seq_len)
    print("fidelity on the perplexity windows ...", file=sys.stderr)
    fidelity = window_fidelity(quantized_model, onnx_q, ids)
    harness = perplexity(quantized_model, tokenizer, text, seq_len=args.seq_len, windows=args.windows)
    matches = greedy_matches(quantized_model, onnx_q, tokenizer)

    print("decoding speed ...", file=sys.stderr)
    prompt = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    labels = {
        "q": f"onnxruntime quantlab {args.bits}-bit",
        "fp32": "onnxruntime fp32",
        "int8": "onnxruntime quantize_dynamic int8",
        "torch_fp32": "PyTorch fp32",
        "torch_q": f"PyTorch quantlab {args.bits}-bit",
    }
    engines = {
        "q": onnx_generator(onnx_q),
        "fp32": onnx_generator(onnx_fp32),
        "int8": onnx_generator(onnx_int8),
        "torch_fp32": torch_generator(float_model),
        "torch_q": torch_generator(quantized_model),
    }
    speeds = measure_speed(engines, prompt, args.decode_tokens, args.rounds)
    median = {name: statistics.median(values) for name, values in speeds.items()}
    ratios = {
        name: statistics.median(a / b for a, b in zip(speeds[name], speeds["torch_fp32"], strict=True))
        for name in speeds
    }

    file_of = {"q": "q", "fp32": "fp32", "int8": "int8"}
    rows = [
        [
            labels[name],
            f"{sizes[file_of[name]] / 1e6:.1f}" if name in file_of else None,
            f"{sizes[file_of[name]] / sizes['fp32']:.3f}" if name in file_of else None,
            number(median[name], 1),
            number(ratios[name], 2),
        ]
        for name in engines
    ]
    print()
    print(f"SmolLM2-135M-Instruct, quantlab {config!r}, {args.threads} threads")
    print(format_table(["engine", "ONNX file MB", "x fp32 file", "decode tokens/s", "x PyTorch fp32"], rows))
    print()
    difference = abs(fidelity["perplexity_onnx"] - fidelity["perplexity_torch"])
    print(
        f"perplexity ({args.windows} x {args.seq_len}): PyTorch quantized {fidelity['perplexity_torch']:.3f} "
        f"(harness {harness:.3f}), onnxruntime {fidelity['perplexity_onnx']:.3f}; "
        f"max |logit difference| {fidelity['max_logit_difference']:.2e}; "
        f"greedy {len(PROMPTS)} prompts x {GREEDY_TOKENS} tokens equal: {matches}/{len(PROMPTS)}"
    )
    checks = [
        ("4-bit file <= 0.35x fp32 file", sizes["q"] / sizes["fp32"], sizes["q"] / sizes["fp32"] <= 0.35),
        ("max |logit difference| <= 1e-3", fidelity["max_logit_difference"], fidelity["max_logit_difference"] <= 1e-3),
        ("|perplexity difference| <= 0.05", difference, difference <= 0.05),
        ("onnxruntime 4-bit decoding >= 3x PyTorch fp32", ratios["q"], ratios["q"] >= 3.0),
        ("greedy tokens equal on 5 prompts", matches, matches == len(PROMPTS)),
    ]
    print(
        format_table(
            ["acceptance check", "value", "pass"], [[c, f"{v:.4g}", "yes" if ok else "NO"] for c, v, ok in checks]
        )
    )
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "onnx",
                "config": config.to_dict(),
                "environment": environment(),
                "bytes": sizes,
                "export_seconds": export_seconds,
                "decode_tokens_per_second": speeds,
                "ratio_to_torch_fp32": ratios,
                "fidelity": {**fidelity, "perplexity_harness": harness, "greedy_matches": matches},
                "checks": {name: passed for name, _, passed in checks},
            },
        )
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
