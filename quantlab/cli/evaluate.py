"""`quantlab eval MODEL`: perplexity, size on disk and stored bits per parameter of a checkpoint.

MODEL is a checkpoint folder (quantized by quantlab or float) or a .gguf file; the work is
`quantlab.workflows.evaluate.evaluate_checkpoint` (float32 compute, as the shared harness and
`benchmarks/quality.py` measure).
"""

import argparse
from dataclasses import asdict

from quantlab.cli.console import Console, add_output_options, bits_summary, disk_size, key_value_table, seconds
from quantlab.cli.evaluation import add_text_options, text_from_args
from quantlab.workflows.evaluate import EvalReport, evaluate_checkpoint


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="measure perplexity, size and bits per parameter of a checkpoint",
        description="Perplexity of a causal LM checkpoint (quantized or float) with the shared harness: "
        "consecutive windows of --seq-len tokens of the text, float32 compute.",
    )
    parser.add_argument("model", metavar="MODEL", help="a checkpoint folder or a .gguf file")
    add_text_options(parser)
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
    return key_value_table(f"evaluated {report.model}", rows)


def run(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    report = evaluate_checkpoint(args.model, text_from_args(args), progress=console.progress)
    console.report(report_table(report), {"command": "eval", **asdict(report)})
    return 0
