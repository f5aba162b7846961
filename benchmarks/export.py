"""GGUF files of SmolLM2-135M: quantlab's calibrated codes exported exactly, beside llama.cpp's own quantizations.

    python benchmarks/export.py                                  # every candidate and peer
    python benchmarks/export.py --only "q4_0 g32 gptq" --peers Q4_0 --rounds 3
    python benchmarks/export.py --keep gguf-files/ --json export.json
    python benchmarks/export.py --only none --gguf gguf-files/a.gguf --no-perplexity   # time files already written

quantlab candidates: SmolLM2 is quantized in float32 by quantlab (calibrated solvers read the
bundled text after the evaluation windows), written with `to_gguf(..., exact=True)` (every
matrix from quantlab's own codes; the export refuses otherwise) and scored twice: by quantlab
itself (PyTorch) and by llama.cpp (llama-cpp-python) reading the GGUF. llama.cpp rounds
activations to 8 bits in its Q4_0 / Q8_0 / IQ4_NL dot products, so the two are close, not equal.
Peers: llama.cpp's own quantizations of the same float weights (`_llama_cpp.quantized_file`).

Per file: size, GGUF types, perplexity on the harness's windows (the first 16 x 512 tokens of
WikiText-2) and on a later part of the same text (16 x 512 tokens from token 200,000: beyond
everything calibration reads), and decode speed in llama.cpp: a plain loop that evaluates one
token at a time and takes the argmax of the logits, every file timed in each round (rounds
alternated, order rotated), median [min-max] tokens/s and the ratio to llama.cpp's own Q4_0 file
in the same round. Needs `gguf` and llama-cpp-python (`pip install 'quantlab[models,peers]'`).
"""

import argparse
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import _llama_cpp
import numpy as np
import torch
from _common import default_text_path, environment, format_table, number, write_json
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantlab
from quantlab.assets.models import smollm2_dir
from quantlab.assets.text import read_text
from quantlab.eval.perplexity import token_ids, window_losses
from quantlab.export.gguf import to_gguf

LATER_PART_OFFSET = 200_000  # tokens; the same later part benchmarks/quality.py scores
BASELINE = "llama.cpp Q4_0"
PEER_TYPES = ("Q4_0", "Q4_K_M", "Q3_K_M", "Q8_0", "IQ4_NL")


def _q4_0(group_size: int, solver: str) -> quantlab.QuantlabConfig:
    return quantlab.CustomBitsConfig(
        bits=4, group_size=group_size, symmetric=True, scale_dtype="float16", solver=solver, embedding_bits=8
    )


CANDIDATES: dict[str, Callable[[], quantlab.QuantlabConfig]] = {
    "q4_0 g32 gptq": lambda: _q4_0(32, "gptq"),
    "q4_0 g64 gptq": lambda: _q4_0(64, "gptq"),
    "q4_0 g32 rtn": lambda: _q4_0(32, "rtn"),
    "q8_0 int8 rtn": lambda: quantlab.Int8SymmetricConfig(group_size=32, scale_dtype="float16", embedding_bits=8),
}


@dataclass
class ExportedFile:
    name: str
    path: Path
    types: dict[str, int]
    requantized: int | None = None  # None: a peer file, made by llama.cpp
    quantlab_perplexity: dict[str, float] = field(default_factory=dict)
    llama_cpp_perplexity: dict[str, float] = field(default_factory=dict)
    tokens_per_second: list[float] = field(default_factory=list)
    ratio_to_baseline: list[float] = field(default_factory=list)
    quantize_seconds: float | None = None

    @property
    def megabytes(self) -> float:
        return self.path.stat().st_size / 1e6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", action="append", choices=[*sorted(CANDIDATES), "none"], help="quantlab candidates (repeat)"
    )
    parser.add_argument("--gguf", action="append", type=Path, default=[], help="also score this GGUF file (repeat)")
    parser.add_argument("--no-perplexity", action="store_true", help="time decoding only")
    parser.add_argument("--peers", nargs="*", default=list(PEER_TYPES), help="llama.cpp's own types to compare")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5, help="decode rounds, every file once per round")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="write the GGUF files here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    return parser.parse_args()


def gguf_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGUF type the file holds."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def llama_cpp_perplexity(path: Path, windows: torch.Tensor, threads: int) -> float:
    """The harness's perplexity (mean next-token loss over each window's `seq_len - 1` predictions), by llama.cpp."""
    import llama_cpp

    seq_len = windows.shape[1]
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=seq_len, n_batch=seq_len, n_threads=threads, logits_all=True, verbose=False
    )
    total = 0.0
    try:
        for window in windows.tolist():
            llm.reset()
            llm.eval(window)
            logits = np.asarray(llm.scores[: seq_len - 1], dtype=np.float64)
            shifted = logits - logits.max(axis=-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
            total -= float(log_probs[np.arange(seq_len - 1), window[1:]].sum())
    finally:
        llm.close()  # now, not at interpreter exit, when llama-cpp-python's bindings are already gone
    return math.exp(total / (len(windows) * (seq_len - 1)))


def text_parts(tokenizer, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The harness's windows and the later part, as `[windows, seq_len]` token ids."""
    ids = token_ids(tokenizer, read_text(default_text_path()))
    size = args.windows * args.seq_len
    parts = {"harness": ids[:size]}
    if len(ids) >= LATER_PART_OFFSET + size:
        parts["later"] = ids[LATER_PART_OFFSET : LATER_PART_OFFSET + size]
    return {name: torch.tensor(part, dtype=torch.long).view(args.windows, args.seq_len) for name, part in parts.items()}


def export_candidate(name: str, args: argparse.Namespace, folder: Path, tokenizer, parts) -> ExportedFile:
    """Quantize SmolLM2 with the candidate's config, export it exactly, and score quantlab's own model."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    started = time.perf_counter()
    quantlab.quantize(model, CANDIDATES[name](), tokenizer=tokenizer, progress=False)
    quantize_seconds = time.perf_counter() - started
    path = folder / f"quantlab-{name.replace(' ', '-')}.gguf"
    result = to_gguf(model, path, tokenizer=tokenizer, exact=True, overwrite=True, name="SmolLM2-135M-Instruct")
    exported = ExportedFile(name, path, gguf_types(path), len(result.requantized), quantize_seconds=quantize_seconds)
    for part, windows in parts.items():
        exported.quantlab_perplexity[part] = math.exp(statistics.mean(window_losses(model, windows)))
    del model
    gc.collect()
    return exported


def time_decoding(files: list[ExportedFile], args: argparse.Namespace, prompt: list[int]) -> None:
    """Tokens per second of a plain one-token-at-a-time loop, every file in every round, order rotated."""
    opened = {
        file.name: _llama_cpp.open_model(file.path, args.threads, args.prompt_tokens + args.decode_tokens)
        for file in files
    }
    models = {name: model for name, model in opened.items() if model is not None}
    files = [file for file in files if file.name in models]
    if not files:
        return
    try:
        for model in models.values():  # warm-up: page the weights in, size the buffers
            model.decode_seconds(prompt, 8)
        for round_index in range(args.rounds):
            order = files[round_index % len(files) :] + files[: round_index % len(files)]
            rates = {}
            for file in order:
                seconds = models[file.name].decode_seconds(prompt, args.decode_tokens)
                rates[file.name] = (args.decode_tokens - 1) / seconds
            for file in files:
                file.tokens_per_second.append(rates[file.name])
                if BASELINE in rates:
                    file.ratio_to_baseline.append(rates[file.name] / rates[BASELINE])
            print(f"  decode round {round_index + 1}/{args.rounds}, load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for model in models.values():
            model.close()


def spread(values: list[float], digits: int) -> str | None:
    if not values:
        return None
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def report(files: list[ExportedFile], args: argparse.Namespace) -> None:
    columns = [
        "file", "MB", "types", "re-quantized", "quantlab ppl", "llama.cpp ppl", "later part (llama.cpp)",
        "decode tok/s", f"x {BASELINE}",
    ]  # fmt: skip
    rows = [
        [
            file.name,
            number(file.megabytes, 1),
            " ".join(f"{kind} {count}" for kind, count in sorted(file.types.items())),
            str(file.requantized) if file.requantized is not None else "n/a (not exported here)",
            number(file.quantlab_perplexity.get("harness"), 3),
            number(file.llama_cpp_perplexity.get("harness"), 3),
            number(file.llama_cpp_perplexity.get("later"), 2),
            spread(file.tokens_per_second, 1),
            spread(file.ratio_to_baseline, 2),
        ]
        for file in files
    ]
    print(format_table(columns, rows))
    print(
        f"\n{args.windows} x {args.seq_len} tokens per perplexity; decode: {args.decode_tokens} tokens after a "
        f"{args.prompt_tokens}-token prompt, {args.rounds} rounds, {args.threads} threads; median [min-max]; "
        f"load average {' '.join(f'{value:.1f}' for value in os.getloadavg())}"
    )


def main() -> int:
    args = parse_args()
    if not _llama_cpp.available():
        print("llama-cpp-python is not installed (pip install 'quantlab[peers]'): nothing to score the files with")
        return 0
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    parts = text_parts(tokenizer, args)
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        files = [
            ExportedFile(f"llama.cpp {kind}", path, gguf_types(path))
            for kind in args.peers
            for path in [_llama_cpp.quantized_file(kind, args.threads)]
        ]
        files += [ExportedFile(path.stem, path, gguf_types(path)) for path in args.gguf]
        for name in args.only or list(CANDIDATES):
            if name != "none":
                print(f"quantizing and exporting: {name}", flush=True)
                files.append(export_candidate(name, args, folder, tokenizer, parts))
        for file in [] if args.no_perplexity else files:
            print(f"scoring {file.name} in llama.cpp", flush=True)
            for part, windows in parts.items():
                file.llama_cpp_perplexity[part] = llama_cpp_perplexity(file.path, windows, args.threads)
        later_text = parts.get("later")
        prompt = (later_text if later_text is not None else parts["harness"])[0, : args.prompt_tokens].tolist()
        time_decoding(files, args, prompt)
        report(files, args)
        if args.json:
            write_json(args.json, {
                "environment": environment(),
                "arguments": {key: str(value) for key, value in vars(args).items()},
                "files": [
                    {
                        "name": file.name, "bytes": file.path.stat().st_size, "types": file.types,
                        "requantized": file.requantized, "quantize_seconds": file.quantize_seconds,
                        "quantlab_perplexity": file.quantlab_perplexity,
                        "llama_cpp_perplexity": file.llama_cpp_perplexity,
                        "tokens_per_second": file.tokens_per_second, "ratio_to_baseline": file.ratio_to_baseline,
                    }
                    for file in files
                ],
            })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
