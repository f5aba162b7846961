"""SmolLM2-135M decoding after long contexts: quantlab's native step on a float32 or an int8 KV cache, and
llama.cpp with an f16 or a q8_0 KV cache, side by side.

    python benchmarks/long_context.py                              # contexts 512 2048 8192, 3 rounds
    python benchmarks/long_context.py --contexts 8192 --rounds 5 --tokens 48
    python benchmarks/decode.py --contexts 512 2048 8192           # the same, from the decode benchmark

quantlab: SmolLM2 quantized while loading (`4bit e8`: 4-bit g64 affine weights, the tied table and head in
int8), decoded by `generate` on the native step with int8 activations
(`compile_for_decoding(native_step=True, int8_activations=True)`), with transformers' float32 static cache
("float cache") or with `kv_bits=8` (`quantlab.QuantizedKVCache`: 8-bit keys per channel and values per
token, the last < 128 tokens in float; "int8 cache"). llama.cpp (`pip install 'quantlab[peers]'`; skipped
with a note when absent): SmolLM2 Q4_0 made by its own quantize API from the same weights, KV cache in f16
(its default) or q8_0 keys and values (with flash attention, which its quantized V cache needs).

Each candidate processes the context (the first C tokens of the text after the evaluation windows) into
its cache once, untimed. Every round then times, for every candidate in rotated order, `--tokens` greedy
tokens after the context: quantlab by two `generate` calls on copies of the filled cache (1 and N new
tokens; the difference is N - 1 decode steps), llama.cpp by its own loop after dropping what the last
round added to its cache. Tables print the median and [min-max] over rounds, ratios taken inside each
round, and the KV cache's bytes at the context; `--peak-memory` adds each candidate's peak resident
memory in a fresh process of its own (load, the context, the new tokens).
"""

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StaticCache

from quantlab import CustomBitsConfig
from quantlab.assets.models import smollm2_dir
from quantlab.generation import compile_for_decoding
from quantlab.generation.kv_cache import QuantizedKVCache
from quantlab.kernels.cpu import native

sys.path.insert(0, str(Path(__file__).parent))
import _llama_cpp
from _common import child_peak_mib, cpu_line, default_text_path, peak_resident_mib
from kernel_speed import Spread, print_table

CONTEXTS = (512, 2048, 8192)
EVALUATION_TOKENS = 16 * 512  # the harness windows: the context is read after them
PREFILL_CHUNK = 512


class QuantlabCandidate:
    """SmolLM2 4-bit e8 on the native step, on a float32 static cache or an 8-bit quantized one."""

    def __init__(self, model, kv_bits: int | None, generation_config) -> None:
        self.model, self.kv_bits, self.config = model, kv_bits, generation_config
        self.filled = None

    def fill(self, context: torch.Tensor, capacity: int) -> None:
        """Process all but the context's last token into a cache of `capacity` tokens, in chunks (untimed)."""
        if self.kv_bits is None:
            cache = StaticCache(config=self.model.config, max_cache_len=capacity)
        else:
            cache = QuantizedKVCache(self.model.config, bits=self.kv_bits, capacity=capacity)
        with torch.no_grad():
            for start in range(0, context.shape[1] - 1, PREFILL_CHUNK):
                chunk = context[:, start : min(start + PREFILL_CHUNK, context.shape[1] - 1)]
                positions = torch.arange(start, start + chunk.shape[1])
                self.model(chunk, past_key_values=cache, use_cache=True, cache_position=positions, logits_to_keep=1)
        self.filled = cache

    def cache_bytes(self) -> int:
        """Bytes the cache holds (allocated for the context and the new tokens)."""
        if self.kv_bits is None:
            return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.filled.layers)
        return self.filled.nbytes

    def seconds(self, context: torch.Tensor, tokens: int) -> tuple[float, int]:
        """Seconds of `generate` for `tokens` new tokens after the filled cache, and the tokens made."""
        cache = copy.deepcopy(self.filled)
        config = copy.copy(self.config)
        config.max_new_tokens, config.do_sample = tokens, False
        start = time.perf_counter()
        out = self.model.generate(
            context, attention_mask=torch.ones_like(context), past_key_values=cache, generation_config=config
        )
        return time.perf_counter() - start, out.shape[1] - context.shape[1]

    def rate(self, context: torch.Tensor, tokens: int) -> float:
        first, _ = self.seconds(context, 1)
        total, made = self.seconds(context, tokens)
        return (made - 1) / (total - first)


class LlamaCppCandidate:
    """llama.cpp's Q4_0 SmolLM2 with a KV cache of `kv_type` ("f16" or "q8_0")."""

    def __init__(self, path: Path, kv_type: str, threads: int, capacity: int) -> None:
        """`capacity`: the longest context and new tokens (llama.cpp allocates its cache for it)."""
        import llama_cpp

        self._llama_cpp = llama_cpp
        ggml_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[kv_type]
        options = {"type_k": ggml_type, "type_v": ggml_type}
        if kv_type != "f16":
            options["flash_attn"] = True
        self.kv_type = kv_type
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=capacity, n_batch=PREFILL_CHUNK, n_threads=threads, n_threads_batch=threads,
            verbose=False, **options,
        )  # fmt: skip
        self.context_length = 0

    def fill(self, context: torch.Tensor, capacity: int) -> None:
        self.llm.reset()
        tokens = context[0].tolist()
        self.llm.eval(tokens[:-1])
        self.last = tokens[-1]
        self.context_length = len(tokens) - 1

    def _next(self) -> int:
        import numpy as np

        logits = self._llama_cpp.llama_get_logits(self.llm.ctx)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))))

    def rate(self, context: torch.Tensor, tokens: int) -> float:
        self.llm.n_tokens = self.context_length  # eval drops the cache's positions past n_tokens
        self.llm.eval([self.last])
        token = self._next()
        start = time.perf_counter()
        for _ in range(tokens - 1):
            self.llm.eval([token])
            token = self._next()
        return (tokens - 1) / (time.perf_counter() - start)

    def cache_bytes(self) -> int:
        """Bytes of the context's keys and values in the cache's type (llama.cpp allocates `capacity`)."""
        config = self.llm.metadata
        layers = int(config["llama.block_count"])
        kv_width = int(config["llama.attention.head_count_kv"]) * (
            int(config["llama.embedding_length"]) // int(config["llama.attention.head_count"])
        )
        per_value = 2.0 if self.kv_type == "f16" else 34 / 32  # q8_0: 32 int8 and one f16 scale per block
        return int(2 * layers * self.context_length * kv_width * per_value)

    def close(self) -> None:
        self.llm.close()


def context_tokens(tokenizer, length: int) -> torch.Tensor:
    """`length` tokens of the text after the evaluation windows (one sequence)."""
    ids = tokenizer(Path(default_text_path()).read_text(encoding="utf-8"), return_tensors="pt").input_ids
    if ids.shape[1] < EVALUATION_TOKENS + length:
        raise SystemExit(f"the text holds {ids.shape[1]} tokens, fewer than {EVALUATION_TOKENS + length}")
    return ids[:, EVALUATION_TOKENS : EVALUATION_TOKENS + length]


QUANTLAB_CANDIDATES = {"ql 4bit e8, float cache": None, "ql 4bit e8, int8 cache": 8}
LLAMA_CPP_CANDIDATES = {"llama.cpp Q4_0, f16 cache": "f16", "llama.cpp Q4_0, q8_0 cache": "q8_0"}


def build(names: list[str], directory: Path, threads: int, capacity: int) -> dict[str, object]:
    """The candidates named (SmolLM2 loaded and quantized once for quantlab's)."""
    candidates: dict[str, object] = {}
    if any(name in QUANTLAB_CANDIDATES for name in names):
        config = CustomBitsConfig(bits=4, group_size=64, embedding_bits=8)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, quantization_config=config)
        compile_for_decoding(model.eval(), max_cache_len=capacity, native_step=True, int8_activations=True)
        generation_config = copy.deepcopy(model.generation_config)
        generation_config.cache_implementation = None  # each call passes its filled cache
    for name in names:
        if name in QUANTLAB_CANDIDATES:
            candidates[name] = QuantlabCandidate(model, QUANTLAB_CANDIDATES[name], generation_config)
        else:
            path = _llama_cpp.quantized_file("Q4_0", threads)
            candidates[name] = LlamaCppCandidate(path, LLAMA_CPP_CANDIDATES[name], threads, capacity)
    return candidates


def peak_memory_mib(name: str, length: int, args) -> float | None:
    """Maximum resident memory of a fresh process that loads this candidate, reads a `length`-token context
    into its cache and decodes `--tokens` tokens after it."""
    command = [sys.executable, __file__, "--peak-memory-of", name, "--contexts", str(length)]
    command += ["--tokens", str(args.tokens), "--threads", str(args.threads)]
    return child_peak_mib(command, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    parser.add_argument("--tokens", type=int, default=32, help="new tokens timed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="skip llama.cpp")
    parser.add_argument("--peak-memory", action="store_true", help="also each candidate's peak RSS, alone")
    parser.add_argument("--peak-memory-of", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    directory = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    capacity = max(args.contexts) + args.tokens + 1
    if args.peak_memory_of:  # the child of peak_memory_mib
        candidate = build([args.peak_memory_of], directory, args.threads, capacity)[args.peak_memory_of]
        context = context_tokens(tokenizer, args.contexts[0])
        candidate.fill(context, capacity)
        candidate.rate(context, args.tokens)
        print(peak_resident_mib())
        return 0
    print(f"{cpu_line(args.threads)}; quantlab kernels: {native.isa()}", flush=True)
    names = list(QUANTLAB_CANDIDATES)
    if args.peers and _llama_cpp.available():
        names += list(LLAMA_CPP_CANDIDATES)
    elif args.peers:
        print("llama.cpp skipped: llama-cpp-python is not installed (pip install 'quantlab[peers]')")
    candidates = build(names, directory, args.threads, capacity)
    rows = []
    for length in args.contexts:
        context = context_tokens(tokenizer, length)
        cache_bytes = {}
        for name, candidate in candidates.items():
            started = time.perf_counter()
            candidate.fill(context, length + args.tokens + 1)
            cache_bytes[name] = candidate.cache_bytes()
            print(f"  {length} tokens into {name}: {time.perf_counter() - started:.0f} s", flush=True)
        rates = {name: Spread() for name in candidates}
        ratios = {name: Spread() for name in candidates}
        for round_index in range(args.rounds):
            measured = {}
            for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                measured[name] = candidates[name].rate(context, args.tokens)
                rates[name].values.append(measured[name])
            for name in candidates:
                ratios[name].values.append(measured[name] / measured[names[0]])
            load = os.getloadavg()[0]
            print(f"  context {length}, round {round_index + 1}/{args.rounds}, load {load:.1f}", flush=True)
        for name in candidates:
            peak = peak_memory_mib(name, length, args) if args.peak_memory else None
            rows.append([
                str(length), name, rates[name].range_text(1), ratios[name].range_text(2),
                f"{cache_bytes[name] / 2**20:.1f}", "" if peak is None else f"{peak:.0f}",
            ])  # fmt: skip
    print_table(
        f"decode tokens/s after the context, {args.tokens} new tokens, {args.threads} threads, {args.rounds} rounds, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        ["context", "candidate", "tokens/s", "x float cache", "KV cache MiB", "peak RSS MiB (alone)"],
        rows,
    )
    for candidate in candidates.values():
        if hasattr(candidate, "close"):
            candidate.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
