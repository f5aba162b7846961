"""`quantlab finetune [MODEL] [--method NAME [method options] | --bitsandbytes] --max-steps N --output-dir DIR`: QLoRA.

The work is `quantlab.workflows.finetune.finetune`: LoRA adapters trained on a base quantized while
it loads (`--method`), loaded as saved (an already quantized checkpoint), quantized by bitsandbytes
(`--bitsandbytes`, NF4 with double quantization, for comparison) or kept in float (neither), on the
bundled WikiText-2 text after its evaluation windows or on `--data FILE`, with held-out perplexity
before and after. DIR is the run folder: `trainer_state.json` (the log), `checkpoint-N`, `final/`
(the adapter, in PEFT's format), `merged/` (with `--merge`) and the report. The same command runs
under `torchrun` or `accelerate launch` (DDP; gloo on CPU); only the first process prints and writes.
"""

import argparse

from quantlab.cli.console import Console, add_output_options, seconds
from quantlab.cli.options import add_method_argument, add_model_argument, config_from_args, finite_float
from quantlab.cli.training_flags import add_training_flags, print_report, resolve_training_flags
from quantlab.workflows.finetune import FinetuneReport, LoraOptions, finetune


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "finetune",
        help="train LoRA adapters on a quantized (QLoRA) or float model",
        description="QLoRA fine-tuning on transformers.Trainer. Method options come from the method's "
        "config: add --method NAME to --help to list them. Without --method (and --bitsandbytes) the base "
        "stays in float.",
    )
    add_model_argument(parser, help="model folder or .gguf file (default: embedded SmolLM2-135M)")
    add_method_argument(parser, required=False)
    parser.add_argument("--bitsandbytes", action="store_true", help="quantize the base with bitsandbytes NF4 instead")
    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--lora-r", type=int, default=16, metavar="R", help="adapter rank (default: 16)")
    lora.add_argument("--lora-alpha", type=finite_float, metavar="A", help="scaling numerator (default: 2 x r)")
    lora.add_argument("--lora-dropout", type=finite_float, default=0.05, metavar="P", help="(default: 0.05)")
    lora.add_argument("--target-modules", default="all-linear", metavar="A,B,...",
                      help="layer names to adapt, comma-separated (default: all-linear, every projection)")  # fmt: skip
    lora.add_argument("--qa-lora", type=int, metavar="G", dest="qalora_group_size",
                      help="QA-LoRA: the adapter reads inputs averaged over runs of G (the base's group size), so "
                      "--merge quantized only moves the zero points (needs custom_bits --no-symmetric)")  # fmt: skip
    lora.add_argument("--merge", choices=("quantized", "float"), help="merge the adapter at the end, and report")
    add_training_flags(parser)
    add_output_options(parser)


def run(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    training_run = resolve_training_flags(args, "finetune")
    lora = LoraOptions(args.lora_r, args.lora_alpha, args.lora_dropout, args.target_modules, args.qalora_group_size)
    lora.validate()
    quantization = config_from_args(args) if args.method else None
    report = finetune(
        args.model,
        training_run,
        quantization=quantization,
        bitsandbytes=args.bitsandbytes,
        lora=lora,
        merge=args.merge,
        progress=console.progress,
        notify=console.note,
    )
    if report is not None:
        print_report(console, f"fine-tuned {report.model} -> {report.output}", report_rows(report), report.as_dict())
    return 0


def report_rows(report: FinetuneReport) -> list[tuple[str, str]]:
    """The report's lines for people."""
    rows = [
        ("base", report.base),
        ("adapters", f"LoRA r={report.lora_r}, {report.trainable_parameters:,} trainable parameters"),
        ("training", f"{report.steps} steps on {report.processes} process(es)"),
    ]
    if report.loss_first is not None:
        rows.append(("loss", f"{report.loss_first:.4f} -> {report.loss_last:.4f}"))
    if report.perplexity_before is not None:
        before, after = report.perplexity_before, report.perplexity_after
        rows.append(("held-out perplexity", f"{before:.3f} -> {after:.3f} ({100 * (after / before - 1):+.1f} %)"))
    if report.seconds_per_step is not None:
        speed = f"{seconds(report.seconds_per_step)}/step, {report.tokens_per_second:.0f} tokens/s"
        rows.append(("speed", speed))
    rows.append(("peak memory", f"{report.peak_memory_mib:.0f} MiB (process peak)"))
    rows.append(("optimizer state", f"{report.optimizer_state_mib:.2f} MiB"))
    if report.merge is not None:
        merge = report.merge
        rows.append((f"merge ({merge['mode']})", f"perplexity {merge['perplexity_adapter']:.3f} -> "
                     f"{merge['perplexity_merged']:.3f} ({100 * merge['perplexity_change']:+.2f} %), max logit change "
                     f"{merge['max_logit_difference']:.2e} -> {merge['path']}"))  # fmt: skip
    return rows
