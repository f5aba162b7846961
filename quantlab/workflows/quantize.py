"""Quantize a model into a checkpoint folder, measured as written.

The model is quantized while transformers loads it (the float model never sits in memory whole),
saved with its tokenizer into a temporary folder beside the output, optionally evaluated from
there, and only then renamed into place: the output is a complete checkpoint or does not exist.
`AutoModelForCausalLM.from_pretrained(output)` reloads it in any process where quantlab is installed.
"""

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantlab.config import QuantlabConfig
from quantlab.errors import QuantlabError
from quantlab.loading import ModelSource, OpenedModel, open_model, resolve_model, weights_size
from quantlab.workflows.notes import DEFAULT_MODEL_NOTE, Notify, notifier
from quantlab.workflows.outputs import REPORT_FILE, check_output, report_json
from quantlab.workflows.text import EvaluationText, reloaded_perplexity


@dataclass
class QuantizeReport:
    """What `quantize_to_checkpoint` did, as saved beside the checkpoint in `quantlab_report.json`."""

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


def quantize_to_checkpoint(
    model: "str | os.PathLike | ModelSource | None",
    config: QuantlabConfig,
    output: str | os.PathLike,
    *,
    overwrite: bool = False,
    evaluate: EvaluationText | None = None,
    progress: bool = False,
    notify: Notify | None = None,
) -> QuantizeReport:
    """Quantize `model` (a folder, a `.gguf` file, None for the embedded default) with `config` into `output`.

    `evaluate`: also measure the perplexity of the float model and of the checkpoint as written.
    `overwrite`: replace an existing `output`; the input model is never replaced.
    """
    note = notifier(notify)
    output = Path(output).expanduser()
    if model is None:
        note(DEFAULT_MODEL_NOTE)
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    if output.resolve() == source.path.resolve():
        raise QuantlabError(f"--output {output} is the model being quantized; write the checkpoint somewhere else")
    check_output(output, overwrite, source.path)
    return _quantize(source, config, output, overwrite, evaluate, progress, note)


def _quantize(
    source: ModelSource,
    config: QuantlabConfig,
    output: Path,
    overwrite: bool,
    text: EvaluationText | None,
    progress: bool,
    note: Notify,
) -> QuantizeReport:
    from quantlab.eval.size import stored_bits_per_weight
    from quantlab.saving import save_quantized
    from quantlab.workflows.stats import layer_summary, parameter_count, peak_memory_bytes

    started, memory_before_load = time.perf_counter(), peak_memory_bytes()
    with open_model(source, scratch=output.parent, progress=progress) as opened:
        _check_quantizable(opened, evaluate=text is not None)
        note(f"quantizing {source} with {config!r}")
        model = opened.load(config)
        tokenizer = opened.tokenizer()
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
                started_evaluation = time.perf_counter()
                note(f"measuring perplexity on {text.describe()}")
                report.perplexity_after = reloaded_perplexity(staging, text, tokenizer, progress)
                report.perplexity_before = reloaded_perplexity(opened.folder, text, tokenizer, progress)
                report.evaluate_seconds = time.perf_counter() - started_evaluation
                report.evaluation_text = text.describe()
            (staging / REPORT_FILE).write_text(report_json(asdict(report)), encoding="utf-8")
            reports.append(report)

        save_quantized(
            model, output, tokenizer, overwrite=overwrite, protect=[source.path], before_commit=report_and_evaluate
        )
    return reports[0]


def _check_quantizable(opened: OpenedModel, evaluate: bool) -> None:
    opened.refuse_quantized("quantize its float original instead")
    if evaluate and not opened.is_causal_lm:
        raise QuantlabError(
            f"--eval measures perplexity, which needs a causal language model, but {opened.source} is a "
            f"{opened.model_class.__name__}; quantize it without --eval"
        )
