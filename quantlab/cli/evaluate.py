"""`quantlab eval MODEL`: perplexity, size on disk and stored bits per parameter of a checkpoint.

MODEL is a checkpoint folder (quantized by quantlab or float) or a .gguf file; the work is
`quantlab.workflows.evaluate.evaluate_checkpoint` (float32 compute, as the shared harness and
`benchmarks/quality.py` measure). `--kv-bits 8|4` prefills each window in chunks of `--kv-chunk`
tokens through a quantized KV cache (`quantlab.QuantizedKVCache`), so that later chunks read the
quantized states of the earlier ones; `--kv-chunk` alone does the same through a float cache.
"""

import argparse
from dataclasses import asdict

from quantlab.cli.console import Console, add_output_options, bits_summary, disk_size, key_value_table, seconds
from quantlab.cli.eval_flags import add_text_options, text_from_args
from quantlab.workflows.evaluate import EvalReport, evaluate_checkpoint


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="measure perplexity, size and bits per parameter of a checkpoint",
        description="Perplexity of a causal LM checkpoint (quantized or float) with the shared harness: "
        "consecutive windows of --seq-len (--context) tokens of the text, float32 compute.",
    )
    parser.add_argument("model", metavar="MODEL", help="a checkpoint folder or a .gguf file")
    add_text_options(parser, context_alias=True)
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=(8, 4),
        help="prefill windows in chunks through a KV cache quantized to these bits",
    )
    parser.add_argument(
        "--kv-chunk", type=int, metavar="N", help="prefill chunk in tokens (default: 256 with --kv-bits)"
    )
    parser.add_argument(
        "--kv-residual",
        type=int,
        metavar="N",
        help="tokens the quantized KV cache keeps in float before quantizing them (default: 128)",
    )
    add_output_options(parser)


def report_table(report: EvalReport) -> str:
    """The report as a table for people."""
    tables = f"; quantized tables: {', '.join(report.tables_quantized)}" if report.tables_quantized else ""
    rows = [
        ("perplexity", f"{report.perplexity:.3f} on {report.evaluation_text}"),
        ("quantization", report.quantization or "none (float)"),
        ("layers", f"{report.layers_quantized} quantized, {report.layers_kept} kept in float{tables}"),
        ("parameters", f"{report.parameters:,}"),
        ("stored bits", bits_summary(report.bits_per_quantized_weight, report.bits_per_parameter)),
        ("size on disk", disk_size(report.size_bytes)),
        ("time", f"{seconds(report.load_seconds)} load, {seconds(report.evaluate_seconds)} evaluate"),
    ]
    if report.kv_chunk is not None:
        kind = f"{report.kv_bits}-bit, float window {report.kv_residual}" if report.kv_bits else "float"
        held = f"{disk_size(report.kv_cache_bytes)}, {report.kv_cache_ratio:.3f}x float32"
        rows.insert(1, ("KV cache", f"{kind}, prefilled {report.kv_chunk} tokens at a time; {held}"))
    return key_value_table(f"evaluated {report.model}", rows)


def run(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    report = evaluate_checkpoint(
        args.model,
        text_from_args(args),
        progress=console.progress,
        kv_bits=args.kv_bits,
        kv_chunk=args.kv_chunk,
        kv_residual=args.kv_residual,
    )
    console.report(report_table(report), {"command": "eval", **asdict(report)})
    return 0
