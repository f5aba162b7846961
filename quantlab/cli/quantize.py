"""`quantlab quantize [MODEL] --method NAME | --preset NAME [method options] --output DIR`: quantize and save.

The work is `quantlab.workflows.quantize.quantize_to_checkpoint`: DIR is a complete checkpoint
(with its tokenizer and `quantlab_report.json`) or does not exist, and
`AutoModelForCausalLM.from_pretrained(DIR)` reloads it in any process where quantlab is installed.
"""

import argparse
from dataclasses import asdict
from typing import Any

from quantlab.cli.console import (
    Console,
    add_output_options,
    bits_summary,
    disk_size,
    key_value_table,
    mebibytes,
    seconds,
)
from quantlab.cli.eval_flags import add_eval_arguments, text_from_args
from quantlab.cli.options import (
    add_method_argument,
    add_model_argument,
    add_output_dir_arguments,
    add_preset_argument,
    config_from_args,
)
from quantlab.errors import QuantlabError
from quantlab.workflows.quantize import QuantizeReport, plan_quantization, quantize_to_checkpoint


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quantize",
        help="quantize a model and save it as a checkpoint",
        description="Quantize the Linear layers of a model with a registered method and save a checkpoint that "
        "from_pretrained reloads. Method options come from the method's config: add --method NAME to --help "
        "to list them.",
    )
    add_model_argument(parser)
    add_method_argument(parser, required=False)
    add_preset_argument(parser)
    add_output_dir_arguments(parser, help="folder to write the checkpoint to (not needed with --plan)", required=False)
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print what would be done (per layer: format, width, group, solver; what stays in float) and stop: "
        "nothing is read but the config, nothing is written",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted quantization into DIR (same model, same options) from its last finished block",
    )
    parser.add_argument(
        "--offload-dir",
        metavar="DIR",
        help="keep the calibration activations in files under DIR (one batch in memory) instead of in memory",
    )
    add_eval_arguments(
        parser,
        help="measure perplexity before and after quantization (an encoder: the cosine of its sentence "
        "embeddings to the float model's on the first 256 lines)",
    )
    add_output_options(parser)


def report_table(report: QuantizeReport) -> str:
    """The report as a table for people."""
    ratio = report.size_after_bytes / report.size_before_bytes if report.size_before_bytes else float("nan")
    sizes = f"{disk_size(report.size_before_bytes)} -> {disk_size(report.size_after_bytes)} ({ratio:.2f}x)"
    options = ", ".join(
        _option_text(k, v) for k, v in report.config.items() if k not in ("quant_method", "format_version")
    )
    kept = f"{len(report.layers_kept)} kept in float" + (
        f" ({_first(report.layers_kept)})" if report.layers_kept else ""
    )
    if report.tables_quantized:
        kept += f"; quantized tables: {', '.join(report.tables_quantized)}"
    if report.padded_groups:
        name, (inputs, group, stored) = next(iter(report.padded_groups.items()))
        others = f" and {len(report.padded_groups) - 1} more" if len(report.padded_groups) > 1 else ""
        kept += (
            f"; {len(report.padded_groups)} with a padded last group ({name}: {inputs} inputs in groups of {group} "
            f"store {stored} codes a row{others}; a group size dividing the inputs stores less)"
        )
    if report.left_in_float:
        name, why = next(iter(report.left_in_float.items()))
        share = report.plan.get("quantized_share")
        kept += (
            f"; {len(report.left_in_float)} weight(s) LEFT IN FLOAT, no quantized module handles them ({name}: {why})"
            + (f": {100 * share:.1f} % of the weights outside the vocabulary quantized" if share is not None else "")
        )
    fallback = report.plan.get("data_free_experts") or {}
    if fallback:
        name, why = next(iter(fallback.items()))
        kept += f"; {len(fallback)} expert slice(s) quantized data-free ({name}: {why})"
    times = f"{seconds(report.load_and_quantize_seconds)} load + quantize, {seconds(report.save_seconds)} save"
    if report.evaluate_seconds is not None:
        times += f", {seconds(report.evaluate_seconds)} evaluate"
    rows = [
        ("method", f"{report.method} ({options})"),
        ("layers", f"{report.layers_quantized} quantized, {kept}"),
        ("parameters", f"{report.parameters:,}"),
        ("stored bits", bits_summary(report.bits_per_quantized_weight, report.bits_per_parameter)),
        ("size on disk", sizes),
        ("time", times),
        ("peak memory", _memory(report)),
    ]
    if report.embedding_cosine_mean is not None:
        rows.append(
            (
                "embeddings",
                f"cosine to the float model's {report.embedding_cosine_mean:.5f} mean, "
                f"{report.embedding_cosine_worst:.5f} worst, on {report.evaluation_text}",
            )
        )
    if report.perplexity_before is not None and report.perplexity_after is not None:
        change = 100 * (report.perplexity_after / report.perplexity_before - 1)
        rows.append(
            (
                "perplexity",
                f"{report.perplexity_before:.3f} -> {report.perplexity_after:.3f} ({change:+.1f} %) "
                f"on {report.evaluation_text}",
            )
        )
    return key_value_table(f"quantized {report.model} -> {report.output}", rows)


def _memory(report: QuantizeReport) -> str:
    """Peak resident memory through load, quantize and save (streamed: with the predicted peak beside it)."""
    peak, before = mebibytes(report.peak_memory_bytes), mebibytes(report.memory_before_load_bytes)
    if report.predicted_peak_memory_bytes is not None:
        predicted = mebibytes(report.predicted_peak_memory_bytes)
        return f"{peak} peak resident, {predicted} predicted ({before} before loading; one block at a time)"
    return f"{peak} peak resident ({before} before loading; includes the memory-mapped input)"


def _option_text(name: str, value: Any) -> str:
    """One option for the report; per-layer choices are summarised (`quantlab inspect` lists them)."""
    if name == "layer_options" and value:
        return f"layer_options=<{len(value)} layers differ: quantlab inspect lists them>"
    return f"{name}={value!r}"


def _first(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def run(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    config = config_from_args(args)
    if args.plan:
        plan = plan_quantization(args.model, config)
        console.report(plan.describe(), {"command": "quantize", "plan": plan.to_dict()})
        return 0
    if args.output is None:
        raise QuantlabError(
            "the following arguments are required: --output/-o (unless --plan, which writes nothing; "
            "see 'quantlab quantize --help')"
        )
    text = text_from_args(args) if args.eval else None
    report = quantize_to_checkpoint(
        args.model,
        config,
        args.output,
        overwrite=args.overwrite,
        evaluate=text,
        progress=console.progress,
        notify=console.note,
        resume=args.resume,
        offload_dir=args.offload_dir,
    )
    console.report(report_table(report), {"command": "quantize", **asdict(report)})
    return 0
