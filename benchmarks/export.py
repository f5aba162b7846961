"""GGUF export of SmolLM2-135M quantized by quantlab, scored by llama.cpp beside quantlab itself.

    python benchmarks/export.py                          # GPTQ 4-bit, groups of 64, symmetric, fp16 scales
    python benchmarks/export.py --solver rtn --windows 4 --json gguf.json

Quantizes SmolLM2 with `CustomBitsConfig(bits=4, group_size=64, symmetric=True, solver=...,
embedding_bits=8)`, writes it with `to_gguf(..., exact=True)` (every matrix from quantlab's own
codes: the Linear layers as Q4_0, the tied int8 embedding table as Q8_0; the export refuses
otherwise), then computes the perplexity of the shared harness's windows (the first 16 x 512
tokens of WikiText-2) with quantlab's model (PyTorch) and with llama.cpp (llama-cpp-python) on
the same token ids and the same formula. llama.cpp rounds activations to 8 bits in its Q4_0 and
Q8_0 dot products, so the two perplexities are close, not equal. Needs `gguf` and llama-cpp-python
(`pip install 'quantlab[models,peers]'`).
"""

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import default_text_path, environment, format_table, number, write_json
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantlab
from quantlab.assets.models import smollm2_dir
from quantlab.assets.text import read_text
from quantlab.eval.perplexity import perplexity, token_ids
from quantlab.export.gguf import to_gguf


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--solver", default="gptq", help="how quantlab chooses the codes (default: gptq)")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, help="keep the GGUF file here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    return parser.parse_args()


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


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    directory = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    config = quantlab.CustomBitsConfig(
        bits=4, group_size=64, symmetric=True, scale_dtype="float16", solver=args.solver, embedding_bits=8
    )
    started = time.perf_counter()
    quantlab.quantize(model, config, tokenizer=tokenizer, progress=False)  # calibrated solvers read the default text
    quantize_seconds = time.perf_counter() - started

    with tempfile.TemporaryDirectory() as scratch:
        path = args.output or Path(scratch) / "smollm2-q4.gguf"
        started = time.perf_counter()
        result = to_gguf(model, path, tokenizer=tokenizer, exact=True, overwrite=True, name="SmolLM2-135M-Instruct")
        export_seconds = time.perf_counter() - started
        text = read_text(default_text_path())
        ids = token_ids(tokenizer, text)[: args.windows * args.seq_len]
        windows = torch.tensor(ids, dtype=torch.long).view(args.windows, args.seq_len)
        theirs = llama_cpp_perplexity(path, windows, args.threads)
    ours = perplexity(model, tokenizer, text, seq_len=args.seq_len, windows=args.windows)

    rows = [
        ["quantlab (PyTorch)", number(ours, 3)],
        ["llama.cpp, the exported GGUF", number(theirs, 3)],
    ]
    print(format_table(["engine", f"perplexity ({args.windows} x {args.seq_len})"], rows))
    print(
        f"\nfile: {result.bytes / 1e6:.1f} MB, {result.type_counts()}, re-quantized: {len(result.requantized)}; "
        f"quantize {quantize_seconds:.0f} s, export {export_seconds:.1f} s",
        file=sys.stderr,
    )
    if args.json:
        write_json(
            args.json,
            {
                "environment": environment(),
                "solver": args.solver,
                "windows": args.windows,
                "seq_len": args.seq_len,
                "perplexity": {"quantlab": ours, "llama_cpp": theirs},
                "gguf": {"bytes": result.bytes, "types": result.type_counts(), "file_type": result.file_type},
                "seconds": {"quantize": quantize_seconds, "export": export_seconds},
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
