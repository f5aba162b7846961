"""`quantlab export onnx [MODEL] --output FILE`: write a checkpoint as one ONNX file for onnxruntime.

The work is `quantlab.workflows.export.export_onnx`: quantized layers become onnxruntime low-bit
operators carrying the checkpoint's own codes and scales; `--ort-dynamic-int8` instead runs
onnxruntime's own dynamic int8 quantization on a float export, for comparison.
"""

import argparse

from quantlab.cli.console import Console, add_output_options, disk_size, key_value_table, seconds
from quantlab.cli.options import MODEL_HELP
from quantlab.workflows.export import export_onnx


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a model to another runtime's format (onnx)",
        description="Export a float or quantlab-quantized checkpoint to another runtime's format.",
    )
    formats = parser.add_subparsers(dest="format", metavar="FORMAT", required=True, parser_class=type(parser))
    onnx = formats.add_parser(
        "onnx",
        help="one ONNX file for onnxruntime, quantized layers as low-bit operators",
        description="Export a causal LM or an encoder (float, or quantized by quantlab) to one ONNX file with dynamic "
        "batch and sequence axes. Quantized layers keep their codes and scales: MatMulNBits (int8, 2/4/8-bit), "
        "MatMulBnb4 (nf4), or a dequantize-and-MatMul fallback for widths onnxruntime lacks.",
    )
    onnx.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help=MODEL_HELP,
    )
    onnx.add_argument("--output", "-o", required=True, metavar="FILE", help="the .onnx file to write")
    onnx.add_argument(
        "--with-past", action="store_true", help="causal LMs: take and return past key values, for generation"
    )
    onnx.add_argument(
        "--ort-dynamic-int8",
        action="store_true",
        help="quantize a float model with onnxruntime's quantize_dynamic (int8; 7-bit weight range, which does not "
        "saturate on CPUs without VNNI) after export, for comparison",
    )
    onnx.add_argument(
        "--accuracy-level",
        type=int,
        default=0,
        choices=(0, 1, 2, 3, 4),
        help="MatMulNBits accuracy level: 0 (default) keeps float activations and matches PyTorch; 4 quantizes "
        "activations to int8, onnxruntime's fast CPU path for 2- and 8-bit weights",
    )
    onnx.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")
    add_output_options(onnx)


def run(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    report = export_onnx(
        args.model,
        args.output,
        with_past=args.with_past,
        ort_dynamic_int8=args.ort_dynamic_int8,
        accuracy_level=args.accuracy_level,
        overwrite=args.overwrite,
        progress=console.progress,
        notify=console.note,
    )
    console.report(
        _table(report.model, report.result, report.export_seconds), {"command": "export onnx", **report.to_json()}
    )
    return 0


def _table(source: str, result, export_seconds: float) -> str:
    layers = ", ".join(f"{count} {op}" for op, count in result.to_json()["quantized_layers"].items()) or "none"
    low_bit = {op: n for op, n in result.operators.items() if op.startswith("com.microsoft::")}
    rows = [
        ("kind", result.kind + (" with past key values" if result.with_past else "")),
        ("size", disk_size(result.bytes)),
        ("quantized layers", layers),
        ("onnxruntime operators", ", ".join(f"{n} {op}" for op, n in low_bit.items()) or "standard ONNX only"),
        ("inputs", ", ".join(_shorten(result.input_names))),
        ("outputs", ", ".join(_shorten(result.output_names))),
        ("time", seconds(export_seconds)),
    ]
    if result.ort_dynamic_int8:
        rows.insert(2, ("quantization", "onnxruntime quantize_dynamic int8 (re-quantized from float)"))
    return key_value_table(f"exported {source} -> {result.path}", rows)


def _shorten(names: list[str], shown: int = 4) -> list[str]:
    return names if len(names) <= shown else [*names[: shown - 1], f"... ({len(names)} in all)"]
