"""`quantlab export onnx|gguf|compressed-tensors [MODEL] --output PATH`: write a checkpoint for another runtime.

`onnx` (`quantlab.workflows.export.export_onnx`): one ONNX file for onnxruntime; quantized layers
become low-bit operators carrying the checkpoint's own codes and scales; `--ort-dynamic-int8`
instead runs onnxruntime's own dynamic int8 quantization on a float export, for comparison.

`gguf` (`quantlab.workflows.export.export_gguf`): one GGUF file for llama.cpp with the tokenizer;
prints each tensor's GGUF type and whether it holds quantlab's own codes or was re-quantized.

`compressed-tensors` (`quantlab.workflows.export.export_compressed_tensors`): a checkpoint folder
transformers and vLLM load with the `compressed-tensors` package; prints each layer's scheme.
"""

import argparse

from quantlab.cli.console import Console, add_output_options, column_table, disk_size, key_value_table, seconds
from quantlab.cli.options import MODEL_HELP
from quantlab.workflows.export import export_compressed_tensors, export_gguf, export_onnx

# The types `--fallback-type` offers (`quantlab.export.gguf.FALLBACK_TYPES`, kept here so that
# `--help` does not import the exporter).
GGUF_FALLBACK_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a model to another runtime's format (onnx, gguf, compressed-tensors)",
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
    _add_gguf_parser(formats)
    _add_compressed_tensors_parser(formats)


def _add_gguf_parser(formats: argparse._SubParsersAction) -> None:
    gguf = formats.add_parser(
        "gguf",
        help="one GGUF file for llama.cpp, quantlab's 4- and 8-bit codes kept where a GGUF type holds them",
        description="Export a Llama-family, Qwen2/3, Mixtral, Qwen2-MoE or Qwen3-MoE causal LM (float, or quantized by "
        "quantlab) and its tokenizer to one GGUF file. Layers whose codes a GGUF type holds exactly keep them: "
        "symmetric 4-bit (fp16 scales, groups of 32 or a multiple) as Q4_0, int8 as Q8_0, asymmetric 4-bit as Q4_1 "
        "when fp16 holds -zero*scale; a mixture's experts as 3-D tensors of those types. Other matrices are "
        "re-quantized to the fallback type; the report lists every tensor.",
    )
    gguf.add_argument("model", nargs="?", metavar="MODEL", help=MODEL_HELP)
    gguf.add_argument("--output", "-o", required=True, metavar="FILE", help="the .gguf file to write")
    gguf.add_argument(
        "--fallback-type",
        choices=GGUF_FALLBACK_TYPES,
        metavar="TYPE",
        help="GGUF type for float matrices and codes no GGUF type holds (default: Q8_0 for the embedding table and "
        f"output head, F16 for the others); one of {', '.join(GGUF_FALLBACK_TYPES)}",
    )
    gguf.add_argument(
        "--exact",
        action="store_true",
        help="refuse to write a matrix whose values in the file would differ from the model's",
    )
    gguf.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")
    add_output_options(gguf)


def _add_compressed_tensors_parser(formats: argparse._SubParsersAction) -> None:
    parser = formats.add_parser(
        "compressed-tensors",
        help="a checkpoint folder transformers and vLLM load with compressed-tensors, quantlab's int4/int8 codes kept",
        description="Export a causal LM quantized by quantlab (custom_bits 4- or 8-bit, int8) and its tokenizer to a "
        "compressed-tensors (pack-quantized) checkpoint folder that AutoModelForCausalLM.from_pretrained loads with "
        "the compressed-tensors package, without quantlab. Codes and scales are kept; float layers stay float. A "
        "layer no compressed-tensors scheme holds exactly (NF4, fractional zero points, other widths) is refused.",
    )
    parser.add_argument("model", nargs="?", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--output", "-o", required=True, metavar="DIR", help="the checkpoint folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    add_output_options(parser)


def run(args: argparse.Namespace) -> int:
    if args.format == "gguf":
        return _run_gguf(args)
    if args.format == "compressed-tensors":
        return _run_compressed_tensors(args)
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


def _run_gguf(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    report = export_gguf(
        args.model,
        args.output,
        fallback_type=args.fallback_type,
        exact=args.exact,
        overwrite=args.overwrite,
        progress=console.progress,
        notify=console.note,
    )
    console.report(
        _gguf_table(report.model, report.result, report.export_seconds), {"command": "export gguf", **report.to_json()}
    )
    return 0


def _gguf_table(source: str, result, export_seconds: float) -> str:
    types = ", ".join(f"{count} {kind}" for kind, count in sorted(result.type_counts().items()))
    requantized = result.requantized
    matrices = sum(len(tensor.shape) == 2 for tensor in result.tensors)
    summary = key_value_table(
        f"exported {source} -> {result.path}",
        [
            ("architecture", f"{result.architecture} ({result.file_type}, pre-tokenizer {result.pre_tokenizer})"),
            ("size", disk_size(result.bytes)),
            ("tensors", types),
            ("from quantlab codes", f"{len(result.from_codes)} of {matrices} matrices"),
            ("re-quantized", f"{len(requantized)} (values differ from the model's)" if requantized else "none"),
            ("time", seconds(export_seconds)),
        ],
    )
    rows = [(t.name, t.type, _origin(t.origin), "yes" if t.exact else "no", t.reason or "-") for t in result.tensors]
    notes = "".join(f"\nnote: {note}" for note in result.notes)
    return f"{summary}\n\n{column_table(['tensor', 'type', 'from', 'exact', 'why'], rows)}{notes}"


def _origin(origin: str) -> str:
    return {"codes": "quantlab codes", "float": "float", "dequantized": "dequantized codes"}.get(origin, origin)


def _run_compressed_tensors(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    report = export_compressed_tensors(
        args.model, args.output, overwrite=args.overwrite, progress=console.progress, notify=console.note
    )
    result = report.result
    schemes = ", ".join(f"{count} {scheme}" for scheme, count in sorted(result.scheme_counts().items()))
    summary = key_value_table(
        f"exported {report.model} -> {result.path}",
        [
            ("format", "compressed-tensors pack-quantized"),
            ("size", disk_size(result.bytes)),
            ("quantized layers", schemes),
            ("float (ignore)", ", ".join(result.ignore) or "none"),
            ("time", seconds(report.export_seconds)),
        ],
    )
    notes = "".join(f"\nnote: {note}" for note in result.notes)
    console.report(summary + notes, {"command": "export compressed-tensors", **report.to_json()})
    return 0
