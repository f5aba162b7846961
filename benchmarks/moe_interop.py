"""A mixture of experts quantized at scale and read back by the peers: `quantlab quantize` on a Qwen3-MoE-shaped
checkpoint (`scale.py`'s `qwen3moe-1b`: ~1B parameters, 16 experts, seeded random weights), then `quantlab export
gguf` and `quantlab export compressed-tensors`, and the logits of the same token ids from

- quantlab (the quantized checkpoint, loaded with quantlab),
- llama.cpp (llama-cpp-python, the `peers` extra) on the GGUF file: the same codes, but llama.cpp rounds the
  activations to 8 bits per block of 32 before its Q4_0/Q8_0 products, so its logits differ by that rounding;
  a routing decision near a tie can then pick another expert for a token, which moves that token further,
- llama.cpp on the same weights decoded to float32 (an F32 file): its float graph without the activation
  rounding, which tells how much of the Q4_0 file's difference that rounding is,
- transformers in a process that never imports quantlab (`QUANTLAB_AUTOLOAD=0`), loading the compressed-tensors
  folder with the `compressed-tensors` package: the same weights, float arithmetic, so equal up to float sums.

Each comparison gives the relative error of the logits (`||theirs - ours|| / ||ours||`, all positions) and the
share of positions whose most likely token agrees. Wall time and peak resident memory of each command are
measured from outside (as `scale.py` does). The checkpoints are written into a scratch folder and deleted.

    python benchmarks/moe_interop.py --output moe-interop                    # RTN 4-bit symmetric g32 (Q4_0)
    python benchmarks/moe_interop.py --solver gptq --expert-calibration all --output moe-interop-gptq
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from _common import cpu_line, environment, format_table, write_json
from scale import SHAPES, measure, write_checkpoint

PROMPT_TOKENS = 48
READER = """
import sys, numpy, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
assert not any(name.startswith("quantlab") for name in sys.modules), "quantlab was imported"
ids = torch.tensor([numpy.load(sys.argv[2]).tolist()])
with torch.no_grad():
    numpy.save(sys.argv[3], model(ids).logits[0].float().numpy())
"""


def prompt(seed: int) -> np.ndarray:
    """Token ids of the byte-level vocabulary the scale checkpoints carry (ids below 256)."""
    return torch.randint(1, 256, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(seed)).numpy()


def quantlab_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    import quantlab  # noqa: F401  (registers the method, as any user process that loads the checkpoint has)

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(torch.tensor([ids.tolist()])).logits[0].float().numpy()


def llama_cpp_logits(path: Path, ids: np.ndarray, threads: int) -> np.ndarray | None:
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed (pip install 'quantlab[peers]'): llama.cpp skipped", file=sys.stderr)
        return None
    llm = llama_cpp.Llama(str(path), n_ctx=2 * PROMPT_TOKENS, n_threads=threads, logits_all=True, verbose=False)
    llm.eval(ids.tolist())
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return logits


def dequantized_file_logits(folder: Path, ids: np.ndarray, scratch: Path, threads: int) -> np.ndarray | None:
    """llama.cpp's logits on the quantized checkpoint's own weights, decoded to float32 and written as an F32 file:
    the same numbers as the Q4_0 file without its 8-bit activation rounding, so the difference of the two
    comparisons is that rounding (and the experts it makes the router pick), the rest llama.cpp's float graph."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quantlab
    from quantlab.export.gguf import to_gguf

    model = quantlab.dequantize(AutoModelForCausalLM.from_pretrained(folder).eval())
    path = scratch / "dequantized.gguf"
    to_gguf(model, path, tokenizer=AutoTokenizer.from_pretrained(folder), fallback_type="F32")
    del model
    try:
        return llama_cpp_logits(path, ids, threads)
    finally:
        path.unlink(missing_ok=True)


def transformers_logits(folder: Path, ids: np.ndarray, scratch: Path) -> np.ndarray:
    """The compressed-tensors folder loaded by transformers in a fresh process without quantlab."""
    np.save(scratch / "ids.npy", ids)
    environment_ = {**os.environ, "QUANTLAB_AUTOLOAD": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, "-c", READER, str(folder), str(scratch / "ids.npy"), str(scratch / "theirs.npy")]
    subprocess.run(command, check=True, env=environment_, cwd=scratch)  # not beside benchmarks/compressed_tensors.py
    return np.load(scratch / "theirs.npy")


def agreement(ours: np.ndarray, theirs: np.ndarray) -> dict[str, float]:
    return {
        "relative_error": float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours)),
        "same_top_token": float((theirs.argmax(-1) == ours.argmax(-1)).mean()),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    output = args.output.resolve()
    output.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="moe-interop-", dir=args.scratch))
    shape = SHAPES[args.shape]
    results: dict[str, dict] = {}
    try:
        checkpoint, quantized = scratch / "float", scratch / "quantized"
        print(f"writing {shape.name} to {checkpoint}", file=sys.stderr, flush=True)
        write_checkpoint(shape, checkpoint, torch.float32, args.seed)
        commands = {
            "quantize": quantize_command(checkpoint, quantized, args),
            "export gguf": [*QUANTLAB, "export", "gguf", str(quantized), "-o", str(scratch / "model.gguf"), "--json"],
            "export compressed-tensors": [
                *QUANTLAB, "export", "compressed-tensors", str(quantized), "-o", str(scratch / "ct"), "--json",
            ],
        }  # fmt: skip
        for name, command in commands.items():
            print(name, file=sys.stderr, flush=True)
            wall, peak = measure(command, output / f"{name.replace(' ', '-')}.log")
            results[name] = {"wall_seconds": wall, "peak_gib": peak / 1024**3, "load_average": os.getloadavg()[0]}
        report = json.loads((quantized / "quantlab_report.json").read_text(encoding="utf-8"))
        ids = prompt(args.seed)
        ours = quantlab_logits(quantized, ids)
        theirs = llama_cpp_logits(scratch / "model.gguf", ids, args.threads)
        if theirs is not None:
            results["llama.cpp"] = agreement(ours, theirs)
            float32 = dequantized_file_logits(quantized, ids, scratch, args.threads)
            results["llama.cpp, the same weights as an F32 file"] = agreement(ours, float32)
        results["transformers without quantlab"] = agreement(ours, transformers_logits(scratch / "ct", ids, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = summary(shape.name, args, results, report)
    (output / "moe_interop.md").write_text(text + "\n", encoding="utf-8")
    payload = {"environment": environment(), "cpu": cpu_line(args.threads), "results": results}
    arguments = {name: str(value) if isinstance(value, Path) else value for name, value in vars(args).items()}
    write_json(output / "moe_interop.json", {**payload, "args": arguments})
    print(text)
    return 0


QUANTLAB = [sys.executable, "-m", "quantlab"]


def quantize_command(checkpoint: Path, output: Path, args: argparse.Namespace) -> list[str]:
    command = [*QUANTLAB, "quantize", str(checkpoint), "-o", str(output), "--method", "custom_bits", "--bits", "4"]
    command += ["--group-size", "32", "--symmetric", "--scale-dtype", "float16", "--solver", args.solver]
    command += ["--quiet", "--json"]
    if args.solver != "rtn":
        command += ["--calibration-samples", str(args.samples), "--calibration-seq-len", str(args.seq_len)]
        command += ["--expert-calibration", args.expert_calibration]
    return command


def summary(shape: str, args: argparse.Namespace, results: dict[str, dict], report: dict) -> str:
    steps = [name for name in results if "wall_seconds" in results[name]]
    rows = [[name, f"{results[name]['wall_seconds']:.1f}", f"{results[name]['peak_gib']:.2f}"] for name in steps]
    rows = [[*row, f"{results[name]['load_average']:.1f}"] for row, name in zip(rows, steps, strict=True)]
    peers = [name for name in results if "relative_error" in results[name]]
    agreement_rows = [
        [name, f"{results[name]['relative_error']:.2e}", f"{100 * results[name]['same_top_token']:.1f} %"]
        for name in peers
    ]
    left = report.get("left_in_float") or {}
    return "\n\n".join(
        [
            f"{shape}, 4-bit symmetric g32 ({args.solver}), {cpu_line(args.threads)}",
            format_table(["step", "wall s", "peak GiB", "load avg"], rows),
            format_table(["reader", "logits relative error", "same most likely token"], agreement_rows),
            f"quantized share of the weights outside the vocabulary: {report['plan']['quantized_share']:.4f}; "
            f"left in float: {', '.join(sorted(left)) or 'nothing'}",
        ]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("moe-interop"), help="where the table and JSON go")
    parser.add_argument("--scratch", type=Path, default=None, help="where the checkpoints go (deleted after)")
    moe_shapes = [name for name, shape in SHAPES.items() if shape.experts]
    parser.add_argument("--shape", choices=moe_shapes, default="qwen3moe-1b")
    parser.add_argument("--solver", choices=["rtn", "mse", "gptq"], default="rtn")
    parser.add_argument("--expert-calibration", choices=["routed", "all"], default="all")
    parser.add_argument("--samples", type=int, default=32, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
