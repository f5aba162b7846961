"""`quantlab inspect MODEL [--reference FLOAT_MODEL]`: what each Linear layer of a checkpoint stores.

Per layer: the method, the code width, the group size, the stored bytes and bits per weight.
Then the vocabulary tables (input embedding, and the output head when it is quantized as a
table or tied to a quantized embedding) and the size of the whole weight file(s) on disk.
With `--reference`, also the relative error of each weight against the float model it
came from, `||W - W_q|| / ||W||` (Frobenius norms, float64).
"""

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from quantlab.cli.console import Console, add_output_options, column_table, disk_size
from quantlab.errors import QuantlabError
from quantlab.loading import ModelSource, load, resolve_model, weights_size
from quantlab.nn import QuantizedLinear
from quantlab.nn.kinds import as_linear, is_quantizable_linear
from quantlab.nn.quantized_embedding import QuantizedTable, TiedOutputHead
from quantlab.vocabulary import find_vocabulary


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="per-layer method, width, group size and stored bytes of a checkpoint",
        description="List every Linear layer of a checkpoint: quantized ones with their method, code width, group "
        "size and stored bytes, float ones as kept. --reference adds each layer's relative weight error.",
    )
    parser.add_argument("model", metavar="MODEL", help="a checkpoint folder (quantized or not)")
    parser.add_argument(
        "--reference",
        nargs="?",
        const=FROM_REPORT,
        metavar="FLOAT_MODEL",
        help="the float model the checkpoint was quantized from (folder or .gguf): adds ||W - W_q|| / ||W||; "
        "without a value, the model named in the checkpoint's quantlab_report.json",
    )
    add_output_options(parser)


@dataclass
class LayerRow:
    name: str
    method: str
    bits: float
    group_size: int | None
    shape: list[int]
    stored_bytes: int
    bits_per_weight: float
    relative_error: float | None = None

    def cells(self, with_error: bool) -> list[Any]:
        group = "-" if self.method == "float" else ("channel" if self.group_size is None else self.group_size)
        cells = [
            self.name,
            self.method,
            f"{self.bits:g}",
            group,
            f"{self.shape[0]}x{self.shape[1]}",
            f"{self.stored_bytes:,}",
            f"{self.bits_per_weight:.3f}",
        ]
        if with_error:
            cells.append("-" if self.relative_error is None else f"{self.relative_error:.2e}")
        return cells


FROM_REPORT = "<from quantlab_report.json>"
HEADERS = ["layer", "method", "width", "group", "out x in", "stored bytes", "bits/weight"]


def run(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    source = resolve_model(args.model)
    model = _load(source, console)
    rows = [_describe(name, module) for name, module in _linear_layers(model)]
    if not rows:
        raise QuantlabError(f"{source} has no Linear layers to inspect")
    tables = _vocabulary_rows(model)
    reference_name = None
    if args.reference is not None:
        reference_source = resolve_model(_reference_path(args.reference, source))
        reference_name = str(reference_source)
        reference = _load(reference_source, console)
        _add_errors(rows, model, reference, reference_name, console)
        _add_table_errors(tables, model, reference)
    with_error = args.reference is not None
    headers = HEADERS + (["rel. error"] if with_error else [])
    table = column_table(headers, [row.cells(with_error) for row in rows])
    total_bytes = sum(row.stored_bytes for row in rows)
    weights = sum(row.shape[0] * row.shape[1] for row in rows)
    summary = (
        f"{sum(row.method != 'float' for row in rows)} of {len(rows)} Linear layers quantized; "
        f"{total_bytes:,} bytes stored for {weights:,} weights ({8 * total_bytes / weights:.3f} bits/weight)"
    )
    file_bytes = weights_size(source.path)
    text = f"{source}\n{table}\n{summary}"
    if tables:
        text += "\n\nvocabulary tables\n" + column_table(
            ["table", *headers[1:]], [row.cells(with_error) for row in tables]
        )
    text += f"\nwhole file: {disk_size(file_bytes)} ({file_bytes:,} bytes, every tensor)"
    console.report(
        text,
        {
            "command": "inspect",
            "model": str(source),
            "reference": reference_name,
            "layers": [asdict(r) for r in rows],
            "tables": [asdict(r) for r in tables],
            "file_bytes": file_bytes,
        },
    )
    return 0


def _reference_path(argument: str, source: ModelSource) -> str:
    """`--reference FLOAT_MODEL` as given, or the model `quantlab quantize` recorded in its report."""
    if argument != FROM_REPORT:
        return argument
    from quantlab.workflows.outputs import REPORT_FILE

    report = source.folder / REPORT_FILE
    if not report.is_file():
        raise QuantlabError(f"{source} has no {REPORT_FILE} naming its float model; pass --reference FLOAT_MODEL")
    return json.loads(report.read_text(encoding="utf-8"))["model_path"]


def _load(source: ModelSource, console: Console) -> nn.Module:
    return load(source, progress=console.progress)


def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (QuantizedLinear, nn.Linear))]


def _vocabulary_rows(model: nn.Module) -> list[LayerRow]:
    """The input embedding, and the output head when it is a quantized table or tied to one."""
    vocabulary = find_vocabulary(model)
    rows = []
    for name in (vocabulary.embedding, vocabulary.head):
        module = model.get_submodule(name) if name is not None else None
        if isinstance(module, QuantizedTable):
            layout = module.layout
            shape = [module.out_features, module.in_features]
            stored = module.stored_bytes()
            method = layout.codec_object.label(layout)
            rows.append(
                LayerRow(name, method, layout.bits, layout.group_size, shape, stored, 8 * stored / _area(shape))
            )
        elif isinstance(module, TiedOutputHead):
            table = module.embedding.layout
            shape = [module.out_features, module.in_features]
            rows.append(LayerRow(name, f"tied to {vocabulary.embedding}", table.bits, table.group_size, shape, 0, 0.0))
        elif isinstance(module, nn.Embedding) and name == vocabulary.embedding:
            weight = module.weight
            shape, stored = list(weight.shape), weight.numel() * weight.element_size()
            rows.append(
                LayerRow(name, "float", 8 * weight.element_size(), None, shape, stored, 8 * stored / weight.numel())
            )
    return rows


def _area(shape: list[int]) -> int:
    return shape[0] * shape[1]


def _add_table_errors(rows: list[LayerRow], model: nn.Module, reference: nn.Module) -> None:
    references = dict(reference.named_modules())
    for row in rows:
        module = model.get_submodule(row.name)
        original = getattr(references.get(row.name), "weight", None)
        if isinstance(module, TiedOutputHead) or original is None or list(original.shape) != row.shape:
            continue
        weight = module.dequantize_weight() if isinstance(module, QuantizedTable) else module.weight
        row.relative_error = relative_error(weight, original)


def _describe(name: str, module: nn.Module) -> LayerRow:
    shape = [module.out_features, module.in_features]
    if isinstance(module, QuantizedLinear):
        layout = module.layout
        group_size, stored = layout.group_size, module.stored_bytes()
        method, bits = module.config.method, layout.bits
    else:
        group_size, stored = None, module.weight.numel() * module.weight.element_size()
        method, bits = "float", 8 * module.weight.element_size()
    return LayerRow(name, method, bits, group_size, shape, stored, 8 * stored / (shape[0] * shape[1]))


def _add_errors(rows: list[LayerRow], model: nn.Module, reference: nn.Module, name: str, console: Console) -> None:
    layers = dict(model.named_modules())
    references = dict(reference.named_modules())
    for row in console.bar(rows, "comparing layers"):
        original = references.get(row.name)
        if original is not None and is_quantizable_linear(original):
            original = as_linear(original)  # GPT-2's `Conv1D`: its `[out, in]` weight
        if not isinstance(original, nn.Linear) or list(original.weight.shape) != row.shape:
            raise QuantlabError(
                f"{name} has no {row.shape[0]}x{row.shape[1]} Linear layer {row.name!r}: "
                f"--reference must be the float model the checkpoint was quantized from"
            )
        row.relative_error = relative_error(_float_weight(layers[row.name]), original.weight)


def _float_weight(module: nn.Module) -> torch.Tensor:
    if isinstance(module, QuantizedLinear):
        return module.dequantize_weight(torch.float32)
    return module.weight


def relative_error(approximation: torch.Tensor, reference: torch.Tensor) -> float:
    """`||reference - approximation|| / ||reference||` in float64 (0 for an all-zero reference)."""
    reference = reference.detach().double()
    norm = reference.norm()
    if norm == 0:
        return 0.0
    return float((reference - approximation.detach().double()).norm() / norm)
