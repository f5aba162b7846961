"""SmolLM2-135M generation on CPU, side by side: torch fp32 and every quantlab method, eager and on the
fast path (`quantlab.generation.compile_for_decoding`), with llama.cpp as an optional peer.

    python benchmarks/decode.py                       # 64 new tokens, 5 rounds, 2 threads
    python benchmarks/decode.py --rounds 3 --tokens 32 --batch-sizes 1 4 16 64
    python benchmarks/decode.py --methods 4bit --paths fast --no-memory --json
    python benchmarks/decode.py --methods "4bit e8" --paths fast fast-unfused --no-memory --no-onnx
    python benchmarks/decode.py --methods "4bit e8" --paths fast fast-int8 --no-memory --no-onnx
    python benchmarks/decode.py --methods "4bit e8" "int8 e8" --paths fast native native-int8 --no-memory --no-onnx
    python benchmarks/decode.py --isa avx2 --methods fp32 "4bit e8" --paths eager native-int8  # AVX2 kernels
    python benchmarks/decode.py --methods fp32 bf16 "4bit bf16" "int8 bf16" --paths eager  # models in bfloat16
    python benchmarks/decode.py --contexts 512 2048 8192 --rounds 3 --tokens 32  # float vs int8 KV cache

Every model is loaded once (quantized while loading); the eager and fast paths of a method share
its weights (one `generate` call each, with its own generation config); `fast-unfused`, the fast path
with `fuse_projections=False` (one quantized call per layer), and `fast-int8`, the fast path with
`int8_activations=True` (4-bit and int8 layers and an int8 head on int8 activations, llama.cpp's
scheme: not bit-exact), `native` and `native-int8`, the fast path with `native_step=True` (one C call a
token for the whole model, quantlab.generation.native; quantized methods only), load a
copy of their own, since a model keeps one compiled step. All candidates are timed
in every round, in rotated order, so ratios compare runs seconds apart on a machine shared with
others; tables print the median and [min-max] over rounds, ratios taken inside each round.

- decode tokens/s: (tokens - 1) / (time of `tokens` new tokens - time of 1), greedy: the prompt
  and the first token cancel out. `generate(max_new_tokens=...)` as a user calls it, without
  `min_new_tokens` (whose logits processor costs time every token and has no counterpart in
  llama.cpp's loop); a run that ends early at an end-of-sequence token is counted by its tokens.
- first token: the time of one new token after a `--prompt-tokens` prompt (prefill included).
- prefill 512: a 512-token prompt processed into the KV cache, logits for its last position only (as
  `generate` and llama.cpp's `eval` do; eager on both paths: transformers compiles only the
  one-token steps), tokens/s; and divided, round by round, by fp32 eager's and by the first `--versus`
  peer's (llama.cpp Q4_0 by default).
- peak RSS: each candidate alone in a fresh process (load, warm-up, prefill, generation), the
  process's maximum resident memory (`--no-memory` skips it; compiling adds the compiler's share).
- `--batch-sizes`: aggregate decode tokens/s of B prompts decoded together, through `generate`
  (eager, fast: a static cache compiled for each B) and transformers' continuous batching
  (`generate_batch`, paged cache) for the methods in `--batch-methods`.

onnxruntime runs quantlab's 4-bit g64 export (MatMulNBits) with its own greedy loop when the `onnx`
extra is installed (`--no-onnx` skips it). llama.cpp peers (Q8_0, Q4_0, Q4_K_M made by its own
quantize API from the same weights) run when
llama-cpp-python is installed (`pip install 'quantlab[peers]'`, a long compile); else a note says
they were skipped. The output head stays fp32 in quantlab's plain methods (transformers keeps tied
embeddings unquantized); the `e8` methods store the tied table and head in int8 (`embedding_bits=8`),
as llama.cpp stores SmolLM2's (Q8_0) in every file compared here.
"""

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from quantlab import CustomBitsConfig, Int8SymmetricConfig, NF4Config
from quantlab.assets.models import smollm2_dir
from quantlab.assets.text import bundled_text
from quantlab.generation import count_compilations, fast_decoding_config
from quantlab.kernels.cpu import native

sys.path.insert(0, str(Path(__file__).parent))
import _llama_cpp
from _common import child_peak_mib, peak_resident_mib
from kernel_speed import Spread, print_table

METHODS = {
    "fp32": None,
    "int8": Int8SymmetricConfig(),
    "nf4": NF4Config(),
    "4bit": CustomBitsConfig(bits=4, group_size=64),
    "3bit": CustomBitsConfig(bits=3, group_size=64),
    # The tied embedding table and output head in int8 too, as llama.cpp stores SmolLM2's (Q8_0: its
    # rows of 576 are not whole k-quant blocks); an fp32 head is read in full every token.
    "int8 e8": Int8SymmetricConfig(embedding_bits=8),
    "nf4 e8": NF4Config(embedding_bits=8),
    "4bit e8": CustomBitsConfig(bits=4, group_size=64, embedding_bits=8),
}
# The same models loaded in bfloat16 (`dtype=torch.bfloat16`): torch's bf16 GEMM for the float model, and for the
# quantized layers at many rows on CPUs with bf16 instructions; eager paths only (the native step is float32).
BF16 = " bf16"
METHODS.update({name + BF16 if name != "fp32" else "bf16": config for name, config in list(METHODS.items())})
PATHS = ("eager", "fast", "fast-unfused", "fast-int8", "native", "native-int8")
PREFILL_TOKENS = 512


@dataclass
class Figures:
    decode: Spread = field(default_factory=Spread)
    first_token: Spread = field(default_factory=Spread)
    prefill: Spread = field(default_factory=Spread)
    tokens: list[int] = field(default_factory=list)


class TorchCandidate:
    """A transformers model on one path: plain `generate`, or the compiled static-cache step."""

    def __init__(self, model, path: str, max_cache_len: int, mode: str) -> None:
        self.model, self.path = model, path
        if path != "eager":
            self.config = fast_decoding_config(
                model, max_cache_len=max_cache_len, mode=mode, fuse_projections=path != "fast-unfused",
                int8_activations=path.endswith("-int8"), native_step=path.startswith("native"),
            )  # fmt: skip
        else:
            self.config = copy.deepcopy(model.generation_config)

    def generate(self, prompt: torch.Tensor, tokens: int, force_length: bool = False) -> tuple[float, list[int]]:
        """Seconds and tokens of `generate(max_new_tokens=tokens)` as a user calls it. `force_length` adds
        `min_new_tokens` (transformers' MinNewTokensLengthLogitsProcessor then masks the end-of-sequence
        token in a vocabulary-sized tensor every step, which llama.cpp's loop does not pay), for batches,
        whose aggregate rate counts every sequence's tokens."""
        start = time.perf_counter()
        out = self.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            generation_config=self.config,
            max_new_tokens=tokens,
            min_new_tokens=tokens if force_length else None,
            do_sample=False,
        )
        return time.perf_counter() - start, out[0, prompt.shape[1] :].tolist()

    def generate_many(self, prompts: torch.Tensor, tokens: int) -> float:
        return self.generate(prompts, tokens, force_length=True)[0]

    def prefill_seconds(self, prompt: torch.Tensor) -> float:
        start = time.perf_counter()
        with torch.no_grad():  # logits of the last position only, as generate's prefill and llama.cpp's eval
            self.model(prompt, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start


class OnnxCandidate:
    """quantlab's 4-bit g64 model exported to ONNX (MatMulNBits, past key values), run by onnxruntime.

    Its greedy loop is `OnnxCausalLM.generate` (numpy around one session run per token); the
    exported graph returns the logits of every prompt position, so its prefill computes the
    whole head, as an ONNX user's would. Exported once per run into a temporary folder.
    """

    NAME = "onnxruntime 4bit"

    def __init__(self, directory: Path, threads: int) -> None:
        from quantlab.export import OnnxCausalLM, to_onnx

        self._folder = tempfile.TemporaryDirectory(prefix="quantlab-decode-onnx-")
        path = Path(self._folder.name) / "smollm2-4bit-g64.onnx"
        to_onnx(load("4bit", directory), path, with_past=True, overwrite=True)
        self.model = OnnxCausalLM(path, threads=threads)

    @staticmethod
    def available() -> bool:
        try:
            import onnxruntime  # noqa: F401

            from quantlab.export import to_onnx  # noqa: F401
        except ImportError:
            return False
        return True

    def generate(self, prompt: torch.Tensor, tokens: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        out = self.model.generate(prompt, max_new_tokens=tokens)
        return time.perf_counter() - start, out[0, prompt.shape[1] :].tolist()

    def prefill_seconds(self, prompt: torch.Tensor) -> float:
        return self.generate(prompt, 1)[0]


class ContinuousBatching:
    """transformers' continuous batching (`generate_batch`) over a model's eager forward."""

    def __init__(self, model) -> None:
        self.model = model

    def generate_many(self, prompts: torch.Tensor, tokens: int) -> float:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        blocks = prompts.shape[0] * -(-(prompts.shape[1] + tokens) // 256) + 4
        batching = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=max(512, prompts.shape[0]))
        start = time.perf_counter()
        self.model.generate_batch(
            prompts.tolist(), generation_config=config, continuous_batching_config=batching, progress_bar=False
        )
        return time.perf_counter() - start


def decode_rate(candidate, prompt, tokens: int) -> tuple[float, float, list[int]]:
    """(decode tokens/s, seconds to the first token, the tokens)."""
    first, _ = candidate.generate(prompt, 1)
    total, generated = candidate.generate(prompt, tokens)
    made = len(generated)  # fewer than `tokens` if it ended at an end-of-sequence token
    rate = (made - 1) / (total - first) if total > first and made > 1 else float("nan")  # a preempted 1-token run
    return rate, first, generated


def in_bf16(name: str) -> bool:
    return name == "bf16" or name.endswith(BF16)


def load(name: str, directory: Path):
    config = METHODS[name]
    kwargs = {} if config is None else {"quantization_config": config}
    if in_bf16(name):
        kwargs["dtype"] = torch.bfloat16
    return AutoModelForCausalLM.from_pretrained(directory, **kwargs).eval()


def models_by_path(name: str, directory: Path, paths: list[str], model=None) -> dict[str, object]:
    """The model each path runs: one for eager and `fast`, a copy for every other path (a model keeps one
    compiled step: two would recompile each other's; int8 activations also turn its eager forwards to int8)."""
    model = model or load(name, directory)
    models = {}
    for path in paths:
        models[path] = model if path in ("eager", "fast") else load(name, directory)
        models[path].generation_config.pad_token_id = model.generation_config.pad_token_id
    return models


def build(args, directory: Path, tokenizer) -> dict[str, object]:
    """name -> candidate, warmed up (the fast paths compiled for one sequence)."""
    candidates: dict[str, object] = {}
    max_cache_len = args.prompt_tokens + args.tokens
    for name in args.methods:
        model = load(name, directory)
        model.generation_config.pad_token_id = tokenizer.eos_token_id
        native = METHODS[name] is not None and not in_bf16(name)
        paths = [path for path in args.paths if native or not path.startswith("native")]
        for path, path_model in models_by_path(name, directory, paths, model).items():
            candidates[f"{name} {path}"] = TorchCandidate(path_model, path, max_cache_len, args.compile_mode)
    for key, candidate in candidates.items():
        start = time.perf_counter()
        with count_compilations() as counts:
            candidate.generate(torch.arange(100, 100 + args.prompt_tokens)[None], 3)
        print(f"  warm-up {key}: {time.perf_counter() - start:.1f} s, {counts}", flush=True)
    if args.onnx and OnnxCandidate.available():
        candidates[OnnxCandidate.NAME] = OnnxCandidate(directory, args.threads)
        candidates[OnnxCandidate.NAME].generate(torch.arange(100, 100 + args.prompt_tokens)[None], 3)
    elif args.onnx:
        print("  note: onnxruntime is not installed, the ONNX candidate skipped (pip install 'quantlab[onnx]')")
    if _llama_cpp.available():
        for quant_type in _llama_cpp.PEER_TYPES:
            path = _llama_cpp.quantized_file(quant_type, args.threads)
            peer = _llama_cpp.open_model(path, args.threads, 2 * PREFILL_TOKENS)
            if peer is not None:
                candidates[f"llama.cpp {quant_type}"] = peer
    else:
        print("  note: llama-cpp-python is not installed, llama.cpp peers skipped (pip install 'quantlab[peers]')")
    return candidates


def as_input(candidate, ids: torch.Tensor):
    return ids[0].tolist() if isinstance(candidate, _llama_cpp.LlamaCppModel) else ids


def timing_rounds(args, candidates: dict[str, object], prompt, long_prompt) -> dict[str, Figures]:
    figures = {name: Figures() for name in candidates}
    names = list(candidates)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            candidate = candidates[name]
            rate, first, generated = decode_rate(candidate, as_input(candidate, prompt), args.tokens)
            figures[name].decode.values.append(rate)
            figures[name].first_token.values.append(first * 1e3)
            figures[name].tokens = generated
            prefill = candidate.prefill_seconds(as_input(candidate, long_prompt))
            figures[name].prefill.values.append(PREFILL_TOKENS / prefill)
        print(f"  round {round_index + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    return figures


def batched_rounds(
    args, directory: Path, models: dict[str, object], texts: torch.Tensor
) -> dict[str, dict[int, Spread]]:
    """Aggregate decode tokens/s at each batch size, for each batched candidate."""
    candidates: dict[str, object] = {}
    max_cache_len = args.prompt_tokens + args.tokens
    for name in args.batch_methods:
        by_path = models_by_path(name, directory, args.paths, models.get(name))
        for path, model in by_path.items():
            candidates[f"{name} {path}"] = TorchCandidate(model, path, max_cache_len, args.compile_mode)
        candidates[f"{name} continuous batching"] = ContinuousBatching(next(iter(by_path.values())))
    rates: dict[str, dict[int, Spread]] = {name: {b: Spread() for b in args.batch_sizes} for name in candidates}
    for batch in args.batch_sizes:
        prompts = texts[:batch]
        for candidate in candidates.values():
            candidate.generate_many(prompts, 2)  # warm-up: the fast path compiles for this batch size
        for _ in range(args.rounds):
            for name, candidate in candidates.items():
                one = candidate.generate_many(prompts, 1)
                total = candidate.generate_many(prompts, args.tokens)
                rate = batch * (args.tokens - 1) / (total - one) if total > one else float("nan")
                rates[name][batch].values.append(rate)
        done = ", ".join(f"{name} {rates[name][batch].range_text(1)}" for name in candidates)
        print(f"  batch size {batch}: {done} tokens/s, load average {os.getloadavg()[0]:.1f}", flush=True)
    return rates


def peak_memory_mib(args, name: str) -> float | None:
    """Maximum resident memory of a fresh process that loads, warms up and runs this candidate alone."""
    command = [sys.executable, __file__, "--peak-memory-of", name, "--tokens", str(args.tokens)]
    command += ["--prompt-tokens", str(args.prompt_tokens), "--threads", str(args.threads), "--isa", args.isa]
    command += ["--compile-mode", args.compile_mode]
    return child_peak_mib(command, name)


def run_alone(args, name: str) -> float:
    """The `--peak-memory-of` child: run one candidate, return ru_maxrss in MiB."""
    directory = smollm2_dir()
    prompt = torch.arange(100, 100 + args.prompt_tokens)[None]
    long_prompt = torch.arange(100, 100 + PREFILL_TOKENS)[None]
    if name.startswith("llama.cpp "):
        path = _llama_cpp.quantized_file(name.split()[-1], args.threads)
        candidate = _llama_cpp.open_model(path, args.threads, 2 * PREFILL_TOKENS)
        if candidate is None:
            raise SystemExit(f"{name}: no llama.cpp setting runs here")
    elif name == OnnxCandidate.NAME:  # the export's own peak counts too, as the fast path's compile does
        candidate = OnnxCandidate(directory, args.threads)
    else:
        method, path = name.rsplit(maxsplit=1)  # method names may hold a space ("4bit e8")
        candidate = TorchCandidate(load(method, directory), path, args.prompt_tokens + args.tokens, args.compile_mode)
    candidate.generate(as_input(candidate, prompt), args.tokens)
    candidate.prefill_seconds(as_input(candidate, long_prompt))
    return peak_resident_mib()


def report(args, figures: dict[str, Figures], memory: dict[str, float | None]) -> None:
    base = "fp32 eager" if "fp32 eager" in figures else next(iter(figures))
    print(
        f"\nSmolLM2-135M greedy, {args.prompt_tokens}-token prompt, {args.tokens} new tokens, {args.threads} threads, "
        f"{args.rounds} rounds, compile mode {args.compile_mode!r}, quantlab kernels: {native.isa()}, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    peers = [name for name in args.versus if name in figures and name != base]
    prefill_versus = [base, *peers]  # prefill: no slower than fp32, and how far from each peer

    def per_round(ours: Spread, theirs: Spread) -> str:
        return Spread([a / b for a, b in zip(ours.values, theirs.values, strict=True)]).range_text()

    rows = []
    for name, figure in figures.items():
        ratio = Spread([a / b for a, b in zip(figure.decode.values, figures[base].decode.values, strict=True)])
        versus = [per_round(figure.decode, figures[peer].decode) for peer in peers]
        prefill_ratios = [per_round(figure.prefill, figures[other].prefill) for other in prefill_versus]
        same = sum(a == b for a, b in zip(figure.tokens, figures[base].tokens, strict=False)) / max(
            len(figure.tokens), 1
        )
        peak = memory.get(name)
        rows.append(
            [
                name,
                figure.decode.range_text(1),
                ratio.range_text(),
                *versus,
                figure.first_token.range_text(0),
                figure.prefill.range_text(0),
                *prefill_ratios,
                "" if peak is None else f"{peak:.0f}",
                f"{same:.0%}",
            ]
        )
    header = ["candidate", "decode tok/s", f"x {base}", *(f"x {peer}" for peer in peers), "first token ms"]
    header += ["prefill 512 tok/s", *(f"prefill x {other}" for other in prefill_versus), "peak RSS MiB"]
    print_table("Median [min-max] over rounds", [*header, f"tokens equal to {base}"], rows)


def report_batched(args, rates: dict[str, dict[int, Spread]]) -> None:
    rows = []
    for name, by_batch in rates.items():
        single = by_batch[args.batch_sizes[0]].median
        rows.append([name, *(f"{s.range_text(1)} ({s.median / single:.1f}x)" for s in by_batch.values())])
    title = f"Aggregate decode tokens/s by concurrent sequences (x the rate at {args.batch_sizes[0]})"
    print_table(title, ["candidate", *(str(b) for b in args.batch_sizes)], rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--paths", nargs="+", default=["eager", "fast"], choices=list(PATHS))
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per generation")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile-mode", default="default", help="torch.compile mode of the fast path")
    parser.add_argument("--batch-sizes", nargs="*", type=int, default=[], help="e.g. 1 4 16 64")
    parser.add_argument("--batch-methods", nargs="+", default=["4bit e8"], choices=list(METHODS))
    parser.add_argument(
        "--versus",
        nargs="*",
        default=["llama.cpp Q4_0", "llama.cpp Q8_0"],
        help="candidates every row is also divided by, round by round (those present)",
    )
    parser.add_argument(
        "--isa",
        choices=["native", "avx512", "avx2", "scalar"],
        default="native",
        help="quantlab's kernels on this instruction set or lower (llama.cpp keeps its own build's)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument(
        "--contexts", nargs="*", type=int, default=[], help="decode after contexts of these lengths (long_context.py)"
    )
    parser.add_argument("--no-onnx", dest="onnx", action="store_false", help="skip the onnxruntime 4-bit candidate")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--peak-memory-of", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.contexts:  # the context-length axis: long_context.py
        import long_context

        rounds = ["--rounds", str(args.rounds), "--threads", str(args.threads), "--tokens", str(args.tokens)]
        return long_context.main(["--contexts", *map(str, args.contexts), *rounds])
    torch.set_num_threads(args.threads)
    if args.isa != "native":
        native.force_isa(args.isa)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if args.peak_memory_of:
        print(run_alone(args, args.peak_memory_of))
        return 0
    directory = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    text = tokenizer(bundled_text(), return_tensors="pt").input_ids[0]
    prompt = text[None, : args.prompt_tokens]
    long_prompt = text[None, :PREFILL_TOKENS]
    candidates = build(args, directory, tokenizer)
    figures = timing_rounds(args, candidates, prompt, long_prompt)
    memory = {} if args.no_memory else {name: peak_memory_mib(args, name) for name in candidates}
    report(args, figures, memory)
    rates = {}
    if args.batch_sizes:
        windows = text[: max(args.batch_sizes) * args.prompt_tokens].view(-1, args.prompt_tokens)
        models = {}  # each method's first model (its eager and fast paths)
        for name, candidate in candidates.items():
            if isinstance(candidate, TorchCandidate):
                models.setdefault(name.rsplit(maxsplit=1)[0], candidate.model)
        rates = batched_rounds(args, directory, models, windows)
        report_batched(args, rates)
    if args.json:
        payload = {
            name: {"decode_tokens_per_second": f.decode.values, "first_token_ms": f.first_token.values}
            | {"prefill_tokens_per_second": f.prefill.values, "peak_rss_mib": memory.get(name)}
            for name, f in figures.items()
        }
        payload["batched"] = {name: {b: s.values for b, s in r.items()} for name, r in rates.items()}
        print(json.dumps(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
