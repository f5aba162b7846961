"""compressed-tensors checkpoints of SmolLM2-135M, loaded by transformers without quantlab.

    python benchmarks/compressed_tensors.py
    python benchmarks/compressed_tensors.py --only "int8 per channel" --windows 4

Each candidate quantizes SmolLM2 in float32 with quantlab (GPTQ reads the bundled text after the
evaluation windows), scores it on the harness's windows (the first 16 x 512 tokens of WikiText-2),
and writes it with `to_compressed_tensors`. A fresh interpreter that never imports quantlab (no
`PYTHONPATH`, `QUANTLAB_AUTOLOAD=0`, checked through `sys.modules`) then loads the folder with
`AutoModelForCausalLM.from_pretrained` (transformers + the compressed-tensors package) and scores the
same windows. Reported per candidate: folder size, both perplexities, and the largest difference of
the two models' logits over every window, relative to the largest logit magnitude of that window
(taken as the maximum over windows). Token ids and logits travel through safetensors files.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import default_text_path, environment, format_table, write_json
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantlab
from quantlab.assets.models import smollm2_dir
from quantlab.assets.text import read_text
from quantlab.eval.perplexity import token_ids
from quantlab.export import to_compressed_tensors

CANDIDATES: dict[str, Callable[[], quantlab.QuantlabConfig]] = {
    "gptq 4-bit g64 symmetric": lambda: quantlab.CustomBitsConfig(bits=4, group_size=64, symmetric=True, solver="gptq"),
    "int8 per channel": lambda: quantlab.Int8SymmetricConfig(),
}

# Runs in a fresh interpreter without quantlab: scores the folder and compares its logits with quantlab's.
_LOADER = """
import json, math, sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
folder, reference = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(folder).eval()
data = load_file(reference)
losses, relative = [], 0.0
with torch.no_grad():
    for index, window in enumerate(data["ids"]):
        output = model(window[None], labels=window[None])
        losses.append(float(output.loss))
        expected = data[f"logits_{index}"]
        difference = (output.logits[0] - expected).abs().max() / expected.abs().max()
        relative = max(relative, float(difference))
print(json.dumps({
    "perplexity": math.exp(sum(losses) / len(losses)),
    "relative": relative,
    "dtype": str(model.dtype),
    "quantlab_imported": any(name.split(".")[0] == "quantlab" for name in sys.modules),
}))
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(CANDIDATES), help="candidates (repeat)")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    return parser.parse_args()


def score_with_quantlab(model, windows: torch.Tensor, reference: Path) -> float:
    """quantlab's perplexity on `windows`; its logits and the ids written to `reference` for the loader."""
    tensors = {"ids": windows}
    losses = []
    with torch.no_grad():
        for index, window in enumerate(windows):
            output = model(window[None], labels=window[None])
            losses.append(float(output.loss))
            tensors[f"logits_{index}"] = output.logits[0].contiguous()
    save_file(tensors, str(reference))
    return math.exp(statistics.mean(losses))


def score_without_quantlab(folder: Path, reference: Path) -> dict:
    """The loader's JSON result: transformers + compressed-tensors alone, in a fresh interpreter."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(QUANTLAB_AUTOLOAD="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", _LOADER, str(folder), str(reference)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"loading {folder.name} without quantlab failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def folder_megabytes(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors")) / 1e6


def run_candidate(name: str, windows: torch.Tensor, tokenizer, scratch: Path) -> dict:
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    started = time.perf_counter()
    quantlab.quantize(model, CANDIDATES[name](), tokenizer=tokenizer, progress=False)
    quantize_seconds = time.perf_counter() - started
    folder, reference = scratch / name.replace(" ", "-"), scratch / f"{name.replace(' ', '-')}.safetensors"
    quantlab_perplexity = score_with_quantlab(model, windows, reference)
    to_compressed_tensors(model, folder, tokenizer=tokenizer)
    del model
    loaded = score_without_quantlab(folder, reference)
    if loaded["quantlab_imported"]:
        raise RuntimeError("the loader imported quantlab; the check would not be independent")
    return {
        "name": name,
        "megabytes": folder_megabytes(folder),
        "quantize_seconds": quantize_seconds,
        "quantlab_perplexity": quantlab_perplexity,
        "transformers_perplexity": loaded["perplexity"],
        "max_relative_logit_difference": loaded["relative"],
        "loaded_dtype": loaded["dtype"],
    }


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    ids = token_ids(tokenizer, read_text(default_text_path()))[: args.windows * args.seq_len]
    windows = torch.tensor(ids, dtype=torch.long).view(args.windows, args.seq_len)
    results = []
    with tempfile.TemporaryDirectory(prefix="quantlab-ct-") as scratch:
        for name in args.only or list(CANDIDATES):
            print(f"quantizing, exporting and loading: {name}", flush=True)
            results.append(run_candidate(name, windows, tokenizer, Path(scratch)))
    columns = ["candidate", "MB", "quantlab ppl", "transformers ppl", "max rel logit diff", "quantize s"]
    rows = [
        [
            r["name"],
            f"{r['megabytes']:.1f}",
            f"{r['quantlab_perplexity']:.3f}",
            f"{r['transformers_perplexity']:.3f}",
            f"{r['max_relative_logit_difference']:.2e}",
            f"{r['quantize_seconds']:.0f}",
        ]
        for r in results
    ]
    print(format_table(columns, rows))
    print(f"load average {os.getloadavg()[0]:.1f}; {args.windows} x {args.seq_len} harness windows")
    if args.json:
        write_json(args.json, {"environment": environment(), "results": results})


if __name__ == "__main__":
    main()
