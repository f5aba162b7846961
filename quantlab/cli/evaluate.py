"""`quantlab eval MODEL`: perplexity, size on disk and stored bits per parameter of a checkpoint.

MODEL is a checkpoint folder (quantized by quantlab or float) or a .gguf file. The model is
loaded in float32 compute, as the shared harness (and `benchmarks/quality.py`) does.
"""

import argparse
import time
from dataclasses import asdict, dataclass, field

import torch

from quantlab.cli.console import Console, add_output_options, bits_summary, disk_size, key_value_table, seconds
from quantlab.cli.evaluation import add_text_options, measure_perplexity, read_text
from quantlab.errors import QuantlabError
from quantlab.loading import (
    float_checkpoint,
    is_causal_lm,
    load_model,
    load_tokenizer,
    model_class,
    quantization_method_of,
    read_config,
    resolve_model,
    weights_size,
)


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


@dataclass
class EvalReport:
    model: str
    quantization: str | None
    perplexity: float
    evaluation_text: str
    tokens: int
    parameters: int
    bits_per_quantized_weight: float | None
    bits_per_parameter: float
    size_bytes: int
    layers_quantized: int
    layers_kept: int
    load_seconds: float
    evaluate_seconds: float
    tables_quantized: list[str] = field(default_factory=list)

    def as_table(self) -> str:
        tables = f"; quantized tables: {', '.join(self.tables_quantized)}" if self.tables_quantized else ""
        rows = [
            ("perplexity", f"{self.perplexity:.3f} on {self.evaluation_text}"),
            ("quantization", self.quantization or "none (float)"),
            ("layers", f"{self.layers_quantized} quantized, {self.layers_kept} kept in float{tables}"),
            ("parameters", f"{self.parameters:,}"),
            ("stored bits", bits_summary(self.bits_per_quantized_weight, self.bits_per_parameter)),
            ("size on disk", disk_size(self.size_bytes)),
            ("time", f"{seconds(self.load_seconds)} load, {seconds(self.evaluate_seconds)} evaluate"),
        ]
        return key_value_table(f"evaluated {self.model}", rows)


def run(args: argparse.Namespace) -> int:
    from quantlab.cli.stats import layer_summary, parameter_count
    from quantlab.eval.size import stored_bits_per_weight

    console = Console.from_args(args)
    text = read_text(args)
    source = resolve_model(args.model)
    started = time.perf_counter()
    with float_checkpoint(source, progress=console.progress) as folder:
        hf_config = read_config(folder)
        cls = model_class(hf_config)
        if not is_causal_lm(cls):
            raise QuantlabError(f"perplexity needs a causal language model, but {source} is a {cls.__name__}")
        tokenizer = load_tokenizer(folder)
        if tokenizer is None:
            raise QuantlabError(f"{source} has no tokenizer, which perplexity needs; save one beside the model")
        model = load_model(folder, cls, dtype=torch.float32)
    loaded = time.perf_counter()
    value = measure_perplexity(model, tokenizer, text, console)
    layers = layer_summary(model)
    parameters, size = parameter_count(model), weights_size(source.path)
    report = EvalReport(
        model=str(source),
        quantization=quantization_method_of(hf_config),
        perplexity=value,
        evaluation_text=text.describe(),
        tokens=text.windows * text.seq_len,
        parameters=parameters,
        bits_per_quantized_weight=stored_bits_per_weight(model) if layers.quantized else None,
        bits_per_parameter=8 * size / parameters,
        size_bytes=size,
        layers_quantized=len(layers.quantized),
        layers_kept=len(layers.kept),
        load_seconds=loaded - started,
        evaluate_seconds=time.perf_counter() - loaded,
        tables_quantized=layers.tables,
    )
    console.report(report.as_table(), {"command": "eval", **asdict(report)})
    return 0
