"""Where one decoded token's time goes with the native step, against the bandwidth bound, and beside
llama.cpp's loop on the same machine.

    python benchmarks/decode_profile.py                         # 4-bit g64 e8, float activations
    python benchmarks/decode_profile.py --methods "4bit e8" "int8 e8" --activation-bits 0 8
    python benchmarks/decode_profile.py --activation-bits 8 --huge-pages both   # weights in 2 MiB pages or not

For each method, in rounds (candidates alternated with llama.cpp's Q4_0 / Q8_0 when installed):

- generate: the per-token time of `generate(max_new_tokens=tokens)` after a prompt (decode.py's
  figure: the time of `tokens` tokens minus the time of one, over `tokens - 1`);
- the C step: `ql_decode_step`'s own time per token inside that generate (the call is timed);
  Python's share is the rest: the step's Python around the call (token lookup, rotary cos/sin,
  logits) and the generate loop (logits processors, argmax, stopping criteria);
- inside the C step, its parts replayed one by one on the same weights: each block's grouped
  projections (q/k/v, o, gate/up, down) through `ql_gemm_group` on one row, attention over a cache
  of the mean decoding length through `ql_attention`, the output head; "rest" is the step's time
  minus those (norms, rotary, SiLU, residual adds, the cache writes, and one thread-team wake-up
  per call saved by the step's own dispatch);
- the bandwidth bound: bytes the step reads per token (codes, scales and zero points of every
  projection and of the head, the keys and values attended over) divided by the copy bandwidth
  of a 256 MB tensor copy measured in the same run (`kernel_speed.copy_bandwidth`).

Replayed parts run each call in a loop and take the median of the loop's mean over rounds; they
are lower bounds of the step's parts (the weights of one part stay warm in the caches where they
fit, which in the step they do not). Prints the load average with each round.
"""

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from quantlab.assets.models import smollm2_dir
from quantlab.generation import fast_decoding_config
from quantlab.generation.native import NativeBlock, NativeDecodeStep
from quantlab.kernels.cpu import native
from quantlab.kernels.cpu.native import QuantlabCpuWeight

sys.path.insert(0, str(Path(__file__).parent))
import _llama_cpp
from decode import METHODS, in_bf16, load
from kernel_speed import Spread, copy_bandwidth

PEERS = {"int8 e8": "Q8_0", "int8": "Q8_0"}  # the llama.cpp type each method is compared with; Q4_0 otherwise
SCALE_BYTES = {0: 4, 1: 2, 2: 2}  # ql_weight scale_dtype: float32, float16, bfloat16
PARTS = ("qkv", "o", "gate_up", "down")


def weight_bytes(weight: QuantlabCpuWeight) -> int:
    """Bytes one product reads of a stored weight: codes, scales (or NF4's absmax codes), zero points."""
    groups = weight.n * weight.groups
    total = groups * weight.group_bytes
    total += groups if weight.absmax_codes else groups * SCALE_BYTES[weight.scale_dtype]
    if weight.zero:
        total += groups * SCALE_BYTES[weight.zero_dtype]
    return total


def _weights_at(block: NativeBlock, first: str) -> ctypes._Pointer:
    """A pointer to block's consecutive weights from field `first` (q/k/v and gate/up lie side by side)."""
    address = ctypes.addressof(block) + getattr(NativeBlock, first).offset
    return ctypes.cast(address, ctypes.POINTER(QuantlabCpuWeight))


def _mean_seconds(call, seconds: float = 0.15) -> float:
    call()
    calls, start = 0, time.perf_counter()
    while calls < 20 or time.perf_counter() - start < seconds:
        call()
        calls += 1
    return (time.perf_counter() - start) / calls


class StepProfile:
    """The native step of one loaded model: its generate timed, the C call timed, its parts replayed."""

    def __init__(self, name: str, activation_bits: int, prompt_tokens: int, tokens: int, huge_pages: bool) -> None:
        os.environ["QUANTLAB_HUGE_PAGES"] = "1" if huge_pages else "0"  # read when the native step is installed
        self.name = name
        self.model = load(name, smollm2_dir())
        self.model.generation_config.pad_token_id = self.model.generation_config.eos_token_id
        self.config = fast_decoding_config(
            self.model, max_cache_len=prompt_tokens + tokens, native_step=True, int8_activations=activation_bits == 8
        )
        self.prompt = torch.arange(100, 100 + prompt_tokens)[None]
        self.tokens, self.activation_bits = tokens, activation_bits
        self.generate(2)  # installs and describes the native step
        step = self.model._compiled_call
        if not isinstance(step, NativeDecodeStep):
            raise SystemExit(f"{name}: the native step is not installed (got {type(step).__name__})")
        self.decoder = step.decoder
        self.c_seconds = 0.0
        inner = self.decoder.step_function

        def timed_call(*arguments):
            start = time.perf_counter()
            status = inner(*arguments)
            self.c_seconds += time.perf_counter() - start
            return status

        self.decoder.step_function = timed_call

    def generate(self, tokens: int) -> tuple[float, int]:
        start = time.perf_counter()
        out = self.model.generate(
            self.prompt, attention_mask=torch.ones_like(self.prompt), generation_config=self.config,
            max_new_tokens=tokens, do_sample=False,
        )  # fmt: skip
        return time.perf_counter() - start, out.shape[1] - self.prompt.shape[1]

    def token_times(self) -> tuple[float, float]:
        """(seconds per decoded token of generate, of the C step), from a 1-token and a full run."""
        self.c_seconds = 0.0
        first, _ = self.generate(1)
        c_first = self.c_seconds
        self.c_seconds = 0.0
        total, made = self.generate(self.tokens)
        steps = made - 1
        return (total - first) / steps, (self.c_seconds - c_first) / steps

    def parts(self, threads: int) -> dict[str, float]:
        """Seconds per token of each replayed part (summed over blocks)."""
        lib, d = self.decoder.lib, self.decoder.struct
        hidden, inter = d.hidden, d.intermediate
        width = max(d.heads * d.head_dim + 2 * d.kv_heads * d.head_dim, 2 * inter, d.head.contents.n if d.head else 0)
        x, y = torch.randn(max(hidden, inter)), torch.empty(width)
        bits = self.activation_bits
        groups = {"qkv": ("q", 3), "o": ("o", 1), "gate_up": ("gate", 2), "down": ("down", 1)}
        seconds = dict.fromkeys(PARTS, 0.0)
        for b in range(d.blocks):
            block = d.block[b]
            for part, (first, count) in groups.items():
                weights = _weights_at(block, first)
                n = sum(weights[i].n for i in range(count))
                k = weights[0].k

                def call(weights=weights, count=count, k=k, n=n):
                    status = lib.ql_gemm_group(weights, count, x.data_ptr(), 1, k, y.data_ptr(), n, threads, bits)
                    if status:
                        raise RuntimeError(f"ql_gemm_group failed with status {status}")

                seconds[part] += _mean_seconds(call, 0.02)
        if d.head:
            head = d.head

            def call_head():
                k, n = head.contents.k, head.contents.n
                lib.ql_gemm_group(head, 1, x.data_ptr(), 1, k, y.data_ptr(), n, threads, bits)

            seconds["head"] = _mean_seconds(call_head)
        seconds["attention"] = d.blocks * self._attention_seconds(threads)
        return seconds

    def _attention_seconds(self, threads: int) -> float:
        lib, d = self.decoder.lib, self.decoder.struct
        length = self.prompt.shape[1] + self.tokens // 2
        q = torch.randn(d.heads * d.head_dim)
        keys, values = torch.randn(d.kv_heads, length, d.head_dim), torch.randn(d.kv_heads, length, d.head_dim)
        out = torch.empty_like(q)
        function = lib.ql_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        function.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
        function.restype = ctypes.c_int
        groups = d.heads // d.kv_heads
        arguments = (q.data_ptr(), keys.data_ptr(), values.data_ptr(), None, None, 1, d.kv_heads, groups, length)
        return _mean_seconds(lambda: function(*arguments, d.head_dim, d.attention_scale, out.data_ptr(), threads))

    def bytes_per_token(self) -> int:
        d = self.decoder.struct
        total = 0
        for b in range(d.blocks):
            for first, count in (("q", 3), ("o", 1), ("gate", 2), ("down", 1)):
                weights = _weights_at(d.block[b], first)
                total += sum(weight_bytes(weights[i]) for i in range(count))
        if d.head:
            total += weight_bytes(d.head.contents)
        length = self.prompt.shape[1] + self.tokens // 2
        return total + d.blocks * 2 * d.kv_heads * length * d.head_dim * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--methods", nargs="+", default=["4bit e8"], choices=[m for m in METHODS if METHODS[m] and not in_bf16(m)]
    )
    parser.add_argument("--activation-bits", nargs="+", type=int, default=[0], choices=[0, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--huge-pages", choices=["on", "off", "both"], default="on",
        help="the step's weights moved into 2 MiB pages (quantlab's default), left in place, or each way alternated",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernels: {native.isa()}, thread pool: {native.thread_pool()}, threads {args.threads}", flush=True)
    pages = {"on": [True], "off": [False], "both": [True, False]}[args.huge_pages]
    profiles = {
        f"{name} a{bits}" + ("" if len(pages) == 1 else " 2M pages" if huge else " 4K pages"): StepProfile(
            name, bits, args.prompt_tokens, args.tokens, huge
        )
        for name in args.methods
        for bits in args.activation_bits
        for huge in pages
    }
    peers = {}
    if _llama_cpp.available():
        for name in args.methods:
            quant_type = PEERS.get(name, "Q4_0")
            path = _llama_cpp.quantized_file(quant_type, args.threads)
            peer = _llama_cpp.open_model(path, args.threads, args.prompt_tokens + args.tokens + 8)
            if peer is not None:
                peers[quant_type] = peer
    else:
        print("note: llama-cpp-python is not installed, llama.cpp's loop skipped (pip install 'quantlab[peers]')")
    prompt = list(range(100, 100 + args.prompt_tokens))
    bandwidth = copy_bandwidth()
    figures: dict[str, dict[str, Spread]] = {key: {} for key in [*profiles, *peers]}
    for round_index in range(args.rounds):
        order = [*profiles, *peers]
        order = order[round_index % len(order) :] + order[: round_index % len(order)]
        for key in order:
            if key in peers:
                seconds = peers[key].decode_seconds(prompt, args.tokens) / (args.tokens - 1)
                figures[key].setdefault("generate", Spread()).values.append(seconds * 1e3)
                continue
            profile = profiles[key]
            token, c_step = profile.token_times()
            row = figures[key]
            row.setdefault("generate", Spread()).values.append(token * 1e3)
            row.setdefault("C step", Spread()).values.append(c_step * 1e3)
            row.setdefault("Python", Spread()).values.append((token - c_step) * 1e3)
            parts = profile.parts(args.threads)
            for part, seconds in parts.items():
                row.setdefault(part, Spread()).values.append(seconds * 1e3)
            row.setdefault("rest of the step", Spread()).values.append((c_step - sum(parts.values())) * 1e3)
        print(f"round {round_index + 1}: load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\ncopy bandwidth {bandwidth / 1e9:.1f} GB/s (256 MB tensor copy, read + write)")
    for key, row in figures.items():
        print(f"\n{key}: ms per token, median [min-max] of {args.rounds} rounds")
        if key in profiles:
            read = profiles[key].bytes_per_token()
            print(f"  bandwidth bound {read / bandwidth * 1e3:.3f} ms ({read / 1e6:.1f} MB read per token)")
        for part, spread in row.items():
            share = f"  {100 * spread.median / row['generate'].median:5.1f} %" if part != "generate" else ""
            print(f"  {part:18s} {spread.range_text(3)}{share}")
    if peers:
        for key in profiles:
            peer = PEERS.get(profiles[key].name, "Q4_0")
            theirs, ours = figures[peer]["generate"].values, figures[key]["generate"].values
            ratios = [p / q for p, q in zip(theirs, ours, strict=True)]
            spread = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
            print(f"{key} tokens/s x llama.cpp {peer}: {spread} (per round)")


if __name__ == "__main__":
    main()
