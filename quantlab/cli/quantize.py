"""`quantlab quantize [MODEL] --method NAME [method options] --output DIR`: quantize and save a checkpoint.

The model is quantized while transformers loads it (the float model never sits in memory whole),
saved with its tokenizer into a temporary folder beside DIR, optionally evaluated from there,
and only then renamed to DIR: DIR is a complete checkpoint or does not exist.
`AutoModelForCausalLM.from_pretrained(DIR)` reloads it in any process where quantlab is installed.
"""

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
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
from quantlab.cli.evaluation import TextSpec, add_eval_arguments, checkpoint_perplexity, read_text
from quantlab.cli.models import add_model_argument
from quantlab.cli.options import add_method_argument, config_from_args
from quantlab.cli.output import REPORT_FILE, add_output_dir_arguments, check_output
from quantlab.config import QuantlabConfig
from quantlab.errors import QuantlabError
from quantlab.loading import (
    ModelSource,
    float_checkpoint,
    is_causal_lm,
    load_with_tokenizer,
    model_class,
    quantization_method_of,
    read_config,
    resolve_model,
    weights_size,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quantize",
        help="quantize a model and save it as a checkpoint",
        description="Quantize the Linear layers of a model with a registered method and save a checkpoint that "
        "from_pretrained reloads. Method options come from the method's config: add --method NAME to --help "
        "to list them.",
    )
    add_model_argument(parser)
    add_method_argument(parser)
    add_output_dir_arguments(parser)
    add_eval_arguments(parser, help="measure perplexity before and after quantization")
    add_output_options(parser)


@dataclass
class QuantizeReport:
    model: str
    model_path: str
    output: str
    method: str
    config: dict[str, Any]
    layers_quantized: int
    layers_kept: list[str]
    parameters: int
    bits_per_quantized_weight: float
    bits_per_parameter: float
    size_before_bytes: int
    size_after_bytes: int
    load_and_quantize_seconds: float
    save_seconds: float
    peak_memory_bytes: int
    memory_before_load_bytes: int
    evaluate_seconds: float | None = None
    perplexity_before: float | None = None
    perplexity_after: float | None = None
    evaluation_text: str | None = None
    tables_quantized: list[str] = field(default_factory=list)  # the vocabulary tables (embedding_bits)

    def as_table(self) -> str:
        ratio = self.size_after_bytes / self.size_before_bytes if self.size_before_bytes else float("nan")
        sizes = f"{disk_size(self.size_before_bytes)} -> {disk_size(self.size_after_bytes)} ({ratio:.2f}x)"
        options = ", ".join(
            _option_text(k, v) for k, v in self.config.items() if k not in ("quant_method", "format_version")
        )
        kept = f"{len(self.layers_kept)} kept in float" + (f" ({_first(self.layers_kept)})" if self.layers_kept else "")
        if self.tables_quantized:
            kept += f"; quantized tables: {', '.join(self.tables_quantized)}"
        times = f"{seconds(self.load_and_quantize_seconds)} load + quantize, {seconds(self.save_seconds)} save"
        if self.evaluate_seconds is not None:
            times += f", {seconds(self.evaluate_seconds)} evaluate"
        rows = [
            ("method", f"{self.method} ({options})"),
            ("layers", f"{self.layers_quantized} quantized, {kept}"),
            ("parameters", f"{self.parameters:,}"),
            ("stored bits", bits_summary(self.bits_per_quantized_weight, self.bits_per_parameter)),
            ("size on disk", sizes),
            ("time", times),
            ("peak memory", _memory(self.peak_memory_bytes, self.memory_before_load_bytes)),
        ]
        if self.perplexity_before is not None and self.perplexity_after is not None:
            change = 100 * (self.perplexity_after / self.perplexity_before - 1)
            rows.append(
                (
                    "perplexity",
                    f"{self.perplexity_before:.3f} -> {self.perplexity_after:.3f} ({change:+.1f} %) "
                    f"on {self.evaluation_text}",
                )
            )
        return key_value_table(f"quantized {self.model} -> {self.output}", rows)


def _memory(peak: int, before: int) -> str:
    """Peak resident memory through load, quantize and save; mapped pages of the input file are resident too."""
    return f"{mebibytes(peak)} peak resident ({mebibytes(before)} before loading; includes the memory-mapped input)"


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
    output = Path(args.output).expanduser()
    text = read_text(args) if args.eval else None
    if args.model is None:
        console.note("using the embedded SmolLM2-135M-Instruct (converted into the cache on first use)")
    source = resolve_model(args.model)
    _check_output(output, source, args.overwrite)
    report = quantize_to_checkpoint(source, config, output, args.overwrite, text, console)
    console.report(report.as_table(), {"command": "quantize", **asdict(report)})
    return 0


def _check_output(output: Path, source: ModelSource, overwrite: bool) -> None:
    if output.resolve() == source.path.resolve():
        raise QuantlabError(f"--output {output} is the model being quantized; write the checkpoint somewhere else")
    check_output(output, overwrite, source.path)


def quantize_to_checkpoint(
    source: ModelSource,
    config: QuantlabConfig,
    output: Path,
    overwrite: bool,
    text: TextSpec | None,
    console: Console,
) -> QuantizeReport:
    """Quantize `source` while loading it, write the checkpoint (and its report) to `output` atomically."""
    from quantlab.cli.stats import layer_summary, parameter_count, peak_memory_bytes
    from quantlab.eval.size import stored_bits_per_weight
    from quantlab.saving import save_quantized

    started, memory_before_load = time.perf_counter(), peak_memory_bytes()
    with float_checkpoint(source, scratch=output.parent, progress=console.progress) as folder:
        _check_quantizable(folder, source, evaluate=text is not None)
        console.note(f"quantizing {source} with {config!r}")
        loaded = load_with_tokenizer(ModelSource(folder, name=str(source)), config)
        model, tokenizer = loaded.model, loaded.tokenizer
        if text is not None and tokenizer is None:
            raise QuantlabError(f"--eval needs a tokenizer, and {source} has none")
        layers = layer_summary(model)
        if not layers.quantized:
            raise QuantlabError(f"no Linear layer of {source} was quantized; check --modules-to-not-convert")
        quantized_at = time.perf_counter()
        reports: list[QuantizeReport] = []

        def report_and_evaluate(staging: Path) -> None:
            """Runs on the complete checkpoint before it is renamed into place: measured as written."""
            report = QuantizeReport(
                model=str(source),
                model_path=str(source.path.resolve()),
                output=str(output),
                method=config.method,
                config=config.to_dict(),
                layers_quantized=len(layers.quantized),
                layers_kept=layers.kept,
                parameters=parameter_count(model),
                bits_per_quantized_weight=stored_bits_per_weight(model),
                bits_per_parameter=8 * weights_size(staging) / parameter_count(model),
                size_before_bytes=weights_size(source.path),
                size_after_bytes=weights_size(staging),
                load_and_quantize_seconds=quantized_at - started,
                save_seconds=time.perf_counter() - quantized_at,
                peak_memory_bytes=peak_memory_bytes(),
                memory_before_load_bytes=memory_before_load,
                tables_quantized=layers.tables,
            )
            if text is not None:
                _evaluate(report, before=folder, after=staging, text=text, tokenizer=tokenizer, console=console)
            (staging / REPORT_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n", encoding="utf-8")
            reports.append(report)

        save_quantized(
            model, output, tokenizer, overwrite=overwrite, protect=[source.path], before_commit=report_and_evaluate
        )
    return reports[0]


def _check_quantizable(folder: Path, source: ModelSource, evaluate: bool) -> None:
    hf_config = read_config(folder)
    already = quantization_method_of(hf_config)
    if already is not None:
        raise QuantlabError(f"{source} is already quantized ({already}); quantize its float original instead")
    cls = model_class(hf_config)
    if evaluate and not is_causal_lm(cls):
        raise QuantlabError(
            f"--eval measures perplexity, which needs a causal language model, but {source} is a {cls.__name__}; "
            f"quantize it without --eval"
        )


def _evaluate(
    report: QuantizeReport, before: Path, after: Path, text: TextSpec, tokenizer: Any, console: Console
) -> None:
    """Perplexity of the float model and of the checkpoint as written (reloaded, as a user would)."""
    started = time.perf_counter()
    console.note(f"measuring perplexity on {text.describe()}")
    report.perplexity_after = checkpoint_perplexity(after, text, console, tokenizer)
    report.perplexity_before = checkpoint_perplexity(before, text, console, tokenizer)
    report.evaluate_seconds = time.perf_counter() - started
    report.evaluation_text = text.describe()
