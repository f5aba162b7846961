"""Quantized Linear kernels on CPU, side by side in one process: milliseconds per call and ratios.

    python benchmarks/kernel_speed.py                      # every shape, rows 1/16/128/512, 5 rounds
    python benchmarks/kernel_speed.py --shapes 2048x8192 --rows 1 --rounds 9 --json
    python benchmarks/kernel_speed.py --isa avx2           # the AVX2 kernels on an AVX-512 CPU
    python benchmarks/kernel_speed.py --activation-bits 8  # int8 activations against fp32 and the float kernels

Candidates: torch fp32, `torch.nn.functional.linear` on the float32 weight (what an fp32 layer
computes, without `nn.Module.__call__`'s cost, which every quantlab layer call pays); quantlab's
reference kernel (dequantize then matmul, 4-bit); quantlab's layers as users run them (int8 per
channel, 4-bit asymmetric and symmetric (and symmetric with its input rotated by a block Hadamard
matrix, `ql 4b sym rot`), 3-bit and 8-bit with groups of 64, NF4 with double
quantization, IQ4_NL), and each of them as the bare `quantlab::linear` operator that a compiled
graph calls (`ql op ...`); the many-row alternative to the
fused kernel, native dequantize then torch's GEMM (`ql dq+mm 4b`); torch fp32 through oneDNN
(`onednn fp32`, `torch._C._nn.mkldnn_linear`: on AMD CPUs MKL's GEMM, which `nn.Linear` uses,
takes its AVX2 path, oneDNN its AVX-512 one, so this shows the headroom at many rows);
bitsandbytes NF4 (double quant) and int8 (LLM.int8); onnxruntime `MatMulNBits` at 4 and 8 bits,
blocks of 64, each a one-node model. `--activation-bits 8` times only torch fp32 and bf16 and the
`quantlab::linear_group` operator on 4-bit (groups of 64) and int8 (per channel) layers, on float activations
(`ql op 4b`, `ql op int8`) and on activations rounded to int8 blocks of 64 (`... i8act`), where this CPU has the
kernels for it; where AMX tiles run (`QUANTLAB_AMX`, quantlab.kernels.cpu.native), `... i8act` is on them and
`... i8act vnni` on the AVX512-VNNI kernel.

The machine is shared and noisy, so every candidate is timed in every round, in rotated
order. A round's figure is its fastest call: on a loaded machine any call longer than a
scheduler time slice is likely to be preempted for tens of milliseconds, which a median would
report as kernel time. Tables show the median over rounds; ratios are taken inside a round
(candidates measured seconds apart) and their median and range over rounds are printed.

The bandwidth bound is the stored weight bytes divided by the measured copy bandwidth (bytes
read + written per second): the time a kernel needs at one row if it only streams its weights
from memory (small weights sit in cache and can beat it).
"""

import argparse
import json
import os
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import quantlab
from quantlab import CustomBitsConfig, Int8SymmetricConfig, IQ4NLConfig, LutConfig, NF4Config
from quantlab.kernels.cpu import native, ops, tune
from quantlab.kernels.reference import dequantize_matmul

SHAPES = [(2048, 8192), (576, 576), (576, 192), (576, 1536), (1536, 576)]
ROWS = [1, 16, 128, 512]
ISA_CODES = {"native", "avx512", "avx2", "scalar"}
Forward = Callable[[torch.Tensor], object]


# -- timing ------------------------------------------------------------------------------------


def time_call(forward: Callable[[], object], min_seconds: float = 0.05, min_calls: int = 5) -> float:
    """Wall time of the fastest call in milliseconds, after one warm-up call."""
    return tune.fastest_ms(forward, min_calls, min_seconds)


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes read plus written per second by a large tensor copy (best of `repeats`)."""
    source = torch.ones(megabytes << 18)
    target = torch.empty_like(source)
    best = min(time_call(lambda: target.copy_(source), 0.0, 1) for _ in range(repeats))
    return 2 * source.numel() * 4 / (best / 1e3)


@dataclass
class Spread:
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def text(self, digits: int = 3) -> str:
        return f"{self.median:.{digits}f}"

    def range_text(self, digits: int = 2) -> str:
        return f"{self.median:.{digits}f} [{min(self.values):.{digits}f}-{max(self.values):.{digits}f}]"


# -- candidates -----------------------------------------------------------------------------------

QUANTLAB = {
    "ql int8": Int8SymmetricConfig(),
    "ql 4b": CustomBitsConfig(bits=4, group_size=64),
    "ql nf4": NF4Config(),
    "ql 3b": CustomBitsConfig(bits=3, group_size=64),
    "ql 4b sym": CustomBitsConfig(bits=4, group_size=64, symmetric=True),
    # the same layer rotating its input by a block Hadamard matrix on every call (`rotate_inputs`)
    "ql 4b sym rot": CustomBitsConfig(bits=4, group_size=64, symmetric=True, rotate_inputs=["layer"]).config_for(
        "layer"
    ),
    "ql 8b": CustomBitsConfig(bits=8, group_size=64),
    "ql iq4_nl": IQ4NLConfig(),
    "ql lut4": LutConfig(bits=4, group_size=64),
    "ql lut3": LutConfig(bits=3, group_size=64),
}


def quantlab_layer(linear: torch.nn.Linear, config) -> quantlab.QuantizedLinear:
    return quantlab.get_method(config.method).module_class.from_linear(linear, config)


def build_candidates(linear: torch.nn.Linear, threads: int) -> tuple[dict[str, Forward], dict[str, int]]:
    """name -> forward(x), and name -> stored weight bytes."""
    weight = linear.weight
    forwards: dict[str, Forward] = {"torch fp32": lambda x: torch.nn.functional.linear(x, weight)}
    sizes = {"torch fp32": linear.weight.numel() * 4}
    reference = quantlab_layer(linear, QUANTLAB["ql 4b"])
    forwards["ql ref 4b"] = lambda x: dequantize_matmul(reference, x)
    for name, config in QUANTLAB.items():
        layer = quantlab_layer(linear, config)
        forwards[name] = layer
        sizes[name] = layer.stored_bytes()
        forwards.update(bare_operators(name, layer))
    dequantize_then_mm = dequantize_then_gemm(quantlab_layer(linear, QUANTLAB["ql 4b"]))
    if dequantize_then_mm is not None:
        forwards["ql dq+mm 4b"] = dequantize_then_mm
    forwards.update(onednn_linear(linear))
    forwards.update(bitsandbytes_layers(linear))
    for bits in (4, 8):
        forward, size = onnxruntime_matmul_nbits(linear, bits, threads)
        if forward is not None:
            forwards[f"ort {bits}b"] = forward
            sizes[f"ort {bits}b"] = size
    return forwards, sizes


def int8_activation_candidates(linear: torch.nn.Linear) -> tuple[dict[str, Forward], dict[str, int]]:
    """torch fp32 and bf16 (x converted in the call) and the grouped operator on float and on int8 activations,
    4-bit g64 and int8 layers; where AMX tiles run, int8 activations also on the AVX512-VNNI kernel (`vnni`)."""
    weight = linear.weight
    weight_bf16 = weight.detach().bfloat16()
    forwards: dict[str, Forward] = {
        "torch fp32": lambda x: torch.nn.functional.linear(x, weight),
        "torch bf16": lambda x: torch.nn.functional.linear(x.bfloat16(), weight_bf16),
    }
    sizes = {"torch fp32": weight.numel() * 4, "torch bf16": weight.numel() * 2}
    if not ops.available() or not native.int8_activations_supported():
        raise SystemExit("--activation-bits 8 needs quantlab's operators and an AVX2 or AVX512-VNNI CPU")
    for name, config in (("4b", QUANTLAB["ql 4b"]), ("int8", QUANTLAB["ql int8"])):
        layer = quantlab_layer(linear, config)
        group = ops.group_arguments([layer])
        forwards[f"ql op {name}"] = lambda x, group=group: ops.linear_group_op(x, *group, 0)
        forwards[f"ql op {name} i8act"] = lambda x, group=group: ops.linear_group_op(x, *group, 8)
        sizes[f"ql op {name}"] = sizes[f"ql op {name} i8act"] = layer.stored_bytes()
        if native.amx_status() == "ready":
            vnni = lambda x, group=group: on_vnni_rows(ops.linear_group_op, x, *group, 8)  # noqa: E731
            forwards[f"ql op {name} i8act vnni"] = vnni
            sizes[f"ql op {name} i8act vnni"] = layer.stored_bytes()
    return forwards, sizes


def on_vnni_rows(call: Callable, *arguments: object) -> object:
    """`call(*arguments)` with the many-row int8-activation products on the AVX512-VNNI kernel instead of AMX."""
    lib = native.library()
    before = lib.ql_a8_rows_choice()
    lib.ql_set_a8_rows(native.ROWS_ISA)
    try:
        return call(*arguments)
    finally:
        lib.ql_set_a8_rows(before)


def bare_operators(name: str, layer: quantlab.QuantizedLinear) -> dict[str, Forward]:
    """A layer as a compiled graph calls it: the bare `quantlab::linear` operator (`ql op 4b` for `ql 4b`),
    and for the 4-bit layer `quantlab::linear_group` on int8 activations (`ql op 4b i8act`, the fast path's
    `int8_activations=True`: not bit-exact) where this CPU has the kernel for it."""
    if not ops.available() or layer.input_rotation:  # the bare operator would skip the rotation
        return {}
    arguments = ops.linear_arguments(layer)
    op_name = name.replace("ql ", "ql op ", 1)
    forwards = {op_name: lambda x: ops.linear_op(x, *arguments)}
    if name == "ql 4b" and native.int8_activations_supported():
        group = ops.group_arguments([layer])
        forwards["ql op 4b i8act"] = lambda x: ops.linear_group_op(x, *group, 8)
    return forwards


def dequantize_then_gemm(layer: quantlab.QuantizedLinear) -> Forward | None:
    """The layer's weight decoded by the native `quantlab::dequantize` op, then torch's fp32 GEMM."""
    if not ops.available():
        return None
    arguments = ops.weight_arguments(layer)
    return lambda x: torch.nn.functional.linear(x, ops.dequantize_op(*arguments))


def onednn_linear(linear: torch.nn.Linear) -> dict[str, Forward]:
    """fp32 through oneDNN (mkldnn), x converted to its layout and back on every call."""
    if not torch.backends.mkldnn.is_available():
        return {}
    weight = linear.weight.detach().to_mkldnn()
    forward = lambda x: torch._C._nn.mkldnn_linear(x.to_mkldnn(), weight).to_dense()  # noqa: E731
    try:
        forward(torch.randn(2, linear.in_features))
    except RuntimeError as error:
        warnings.warn(f"oneDNN fp32 left out: {error}", stacklevel=2)
        return {}
    return {"onednn fp32": forward}


def bitsandbytes_layers(linear: torch.nn.Linear) -> dict[str, Forward]:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return {}
    weight = linear.weight.data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nf4 = bnb.nn.Linear4bit(*reversed(weight.shape), bias=False, compute_dtype=torch.float32, quant_type="nf4")
        nf4.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4", compress_statistics=True)
        int8 = bnb.nn.Linear8bitLt(*reversed(weight.shape), bias=False, has_fp16_weights=False)
        int8.weight = bnb.nn.Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False)
        return {"bnb nf4": nf4.to("cpu"), "bnb int8": int8.to("cpu")}


def onnxruntime_matmul_nbits(linear: torch.nn.Linear, bits: int, threads: int) -> tuple[Forward | None, int]:
    """A one-node MatMulNBits model (block 64, zero points) quantized by onnxruntime's own tool."""
    try:
        import logging

        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as error:
        warnings.warn(f"onnxruntime MatMulNBits left out: {error}", stacklevel=2)
        return None, 0
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    out_features, in_features = linear.weight.shape
    weight = numpy_helper.from_array(linear.weight.detach().T.contiguous().numpy(), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", in_features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", out_features])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=64, is_symmetric=False)
    quantizer.process()
    quantized = quantizer.model.model
    size = sum(numpy_helper.to_array(t).nbytes for t in quantized.graph.initializer)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(quantized.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return (lambda x: session.run(None, {"x": x.numpy()})), size


# -- the run --------------------------------------------------------------------------------------

RATIOS = {  # label -> (numerator, denominator): > 1 means the quantlab kernel is faster
    "fp32 / ql 4b": ("torch fp32", "ql 4b"),
    "fp32 / ql op 4b": ("torch fp32", "ql op 4b"),
    "fp32 / ql op 4b i8act": ("torch fp32", "ql op 4b i8act"),
    "fp32 / ql op int8 i8act": ("torch fp32", "ql op int8 i8act"),
    "ql op 4b / ql op 4b i8act": ("ql op 4b", "ql op 4b i8act"),
    "ql op int8 / ql op int8 i8act": ("ql op int8", "ql op int8 i8act"),
    "bf16 / ql op 4b i8act": ("torch bf16", "ql op 4b i8act"),
    "bf16 / ql op int8 i8act": ("torch bf16", "ql op int8 i8act"),
    "vnni / amx 4b i8act": ("ql op 4b i8act vnni", "ql op 4b i8act"),
    "vnni / amx int8 i8act": ("ql op int8 i8act vnni", "ql op int8 i8act"),
    "fp32 / ql int8": ("torch fp32", "ql int8"),
    "bnb nf4 / ql 4b": ("bnb nf4", "ql 4b"),
    "bnb int8 / ql int8": ("bnb int8", "ql int8"),
    "ort 4b / ql 4b": ("ort 4b", "ql 4b"),
    "ort 8b / ql int8": ("ort 8b", "ql int8"),
    "fp32 / ql nf4": ("torch fp32", "ql nf4"),
    "fp32 / ql 3b": ("torch fp32", "ql 3b"),
    "fp32 / ql 4b sym": ("torch fp32", "ql 4b sym"),
    "fp32 / ql 8b": ("torch fp32", "ql 8b"),
    "fp32 / ql iq4_nl": ("torch fp32", "ql iq4_nl"),
    "fp32 / ql lut4": ("torch fp32", "ql lut4"),
    "fp32 / ql lut3": ("torch fp32", "ql lut3"),
    **{
        f"fp32 / ql op {f}": ("torch fp32", f"ql op {f}")
        for f in ("int8", "nf4", "3b", "4b sym", "8b", "iq4_nl", "lut4", "lut3")
    },
    "fp32 / ql dq+mm 4b": ("torch fp32", "ql dq+mm 4b"),
    "onednn fp32 / ql 4b": ("onednn fp32", "ql 4b"),
}


def run_case(forwards: dict[str, Forward], in_features: int, rows: int, rounds: int) -> dict[str, Spread]:
    x = torch.randn(rows, in_features)
    times = {name: Spread() for name in forwards}
    names = list(forwards)
    with torch.no_grad():
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].values.append(time_call(lambda name=name: forwards[name](x)))
    return times


def ratios(times: dict[str, Spread]) -> dict[str, Spread]:
    out = {}
    for label, (numerator, denominator) in RATIOS.items():
        if numerator in times and denominator in times:
            pairs = zip(times[numerator].values, times[denominator].values, strict=True)
            out[label] = Spread([a / b for a, b in pairs])
    return out


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)) + " |")


def pool_report() -> str:
    """Whose threads quantlab's calls ran on. Calls move to the library's own pool when joins on torch's
    OpenMP team stall (a busy machine): torch fp32 then pays those stalls and quantlab does not, so the
    ratios of such a run overstate quantlab against a quiet machine."""
    lib = native.library()
    if lib is None:
        return "quantlab kernels unavailable"
    team, own = lib.ql_pool_calls(1), lib.ql_pool_calls(0)
    note = " (torch's team stalled: a busy machine, fp32 figures include stalls)" if own > team / 20 else ""
    return f"multi-threaded quantlab calls on torch's OpenMP team {team}, on the library's own pool {own}{note}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in SHAPES], help="INxOUT")
    parser.add_argument("--rows", nargs="+", type=int, default=ROWS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument(
        "--isa", choices=sorted(ISA_CODES), default="native", help="quantlab's kernels on this instruction set or lower"
    )
    parser.add_argument(
        "--activation-bits",
        type=int,
        choices=(0, 8),
        default=0,
        help="8: time int8 activations (4-bit g64 and int8 layers) against torch fp32 and the float kernels",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.isa != "native":
        native.force_isa(args.isa)
    torch.manual_seed(0)

    lib = native.library()
    if lib is not None:  # every format's product at many rows, measured (or read from the cache) before timing
        tune.settle_all(lib)
    bandwidth = copy_bandwidth()
    print(
        f"CPU {tune.cpu_name()}, flags {' '.join(tune.cpu_flags()) or 'none'}; torch {torch.__version__} fp32 "
        f"{tune.fp32_gflops():.0f} GFLOP/s (1024^3), {args.threads} threads, quantlab kernels: {native.isa()}, "
        f"products {tune.setting()}, AMX: {native.amx_status()}, copy bandwidth {bandwidth / 1e9:.1f} GB/s, "
        f"load average {os.getloadavg()[0]:.1f}, {args.rounds} rounds"
    )
    results = []
    for shape in args.shapes:
        in_features, out_features = (int(v) for v in shape.split("x"))
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        torch.nn.init.normal_(linear.weight, std=0.02)
        linear.requires_grad_(False)
        if args.activation_bits == 8:
            forwards, sizes = int8_activation_candidates(linear)
        else:
            forwards, sizes = build_candidates(linear, args.threads)
        for rows in args.rows:
            times = run_case(forwards, in_features, rows, args.rounds)
            bounds = {name: size / bandwidth * 1e3 for name, size in sizes.items()}
            results.append({"shape": shape, "rows": rows, "times": times, "ratios": ratios(times), "bounds": bounds})
            print(f"  done {shape} M={rows}", flush=True)

    names = list(results[0]["times"])
    print_table(
        "Milliseconds per call (fastest call of a round, median over rounds; lower is better)",
        ["shape", "M", *names],
        [[r["shape"], r["rows"], *(r["times"][n].text() for n in names)] for r in results],
    )
    bound_names = [
        n for n in ("torch fp32", "ql int8", "ql 4b", "ql nf4", "ql 3b", "ort 4b") if n in results[0]["bounds"]
    ]
    print_table(
        "Bandwidth bound at M=1: stored weight bytes / copy bandwidth (ms)",
        ["shape", *bound_names],
        [[r["shape"], *(f"{r['bounds'][n]:.3f}" for n in bound_names)] for r in results if r["rows"] == 1],
    )
    labels = list(results[0]["ratios"])
    print_table(
        "Speed ratios, median [min-max] over rounds (> 1: quantlab faster)",
        ["shape", "M", *labels],
        [[r["shape"], r["rows"], *(r["ratios"][label].range_text() for label in labels)] for r in results],
    )
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    print(pool_report())
    if args.json:
        summary = {
            "threads": args.threads,
            "copy_bandwidth_gbs": bandwidth / 1e9,
            "results": [
                {
                    "shape": r["shape"],
                    "rows": r["rows"],
                    "ms": {n: s.median for n, s in r["times"].items()},
                    "ms_rounds": {n: s.values for n, s in r["times"].items()},
                    "ratios": {n: s.median for n, s in r["ratios"].items()},
                    "bound_ms": r["bounds"],
                }
                for r in results
            ],
        }
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
