"""Quantize a model into a checkpoint folder, measured as written.

A safetensors checkpoint is quantized streamed (`quantlab.streaming`): one decoder block in float
memory at a time, each block's stored tensors written to the output as soon as it is quantized,
in a staging folder beside the output that `resume=True` continues after an interruption. Other
sources (`.bin` weights, tensor names the model renames on load) are quantized while transformers
loads them and saved whole. Either way the result is optionally evaluated from the staging folder
and only then renamed into place: the output is a complete checkpoint or does not exist.
`AutoModelForCausalLM.from_pretrained(output)` reloads it in any process where quantlab is installed.
"""

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantlab import distributed
from quantlab.config import QuantlabConfig
from quantlab.errors import QuantlabError
from quantlab.loading import ModelSource, OpenedModel, open_model, resolve_model, weights_size
from quantlab.workflows.notes import DEFAULT_MODEL_NOTE, Notify, notifier
from quantlab.workflows.outputs import REPORT_FILE, check_output, report_json
from quantlab.workflows.text import EvaluationText, reloaded_embedding_cosines, reloaded_perplexity

if TYPE_CHECKING:
    from quantlab.plan import QuantizationPlan


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
    # An encoder (no next-token head) is measured by its sentence embeddings' cosine to the float model's
    embedding_cosine_mean: float | None = None
    embedding_cosine_worst: float | None = None
    evaluation_text: str | None = None
    tables_quantized: list[str] = field(default_factory=list)  # the vocabulary tables (embedding_bits)
    streamed: bool = False  # one block in memory at a time (else loaded whole)
    predicted_peak_memory_bytes: int | None = None  # streamed: `quantlab.streaming.memory.predict_peak`
    predicted_memory_terms: dict[str, int] = field(default_factory=dict)
    processes: int = 1  # processes that calibrated together (torchrun); rank 0 wrote the checkpoint
    # Layers whose group size does not divide their inputs, so the last group is padded (stored, never used):
    # name -> (inputs, group size, codes stored a row)
    padded_groups: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    # What was planned (`quantlab.plan.QuantizationPlan.to_dict`): per layer format, width, group, solver;
    # every weight left in float and why; the share of the weights outside the vocabulary quantized
    plan: dict[str, Any] = field(default_factory=dict)
    # Weights no quantized module handles (name -> why): never left in float without a word
    left_in_float: dict[str, str] = field(default_factory=dict)


def quantize_to_checkpoint(
    model: "str | os.PathLike | ModelSource | None",
    config: QuantlabConfig,
    output: str | os.PathLike,
    *,
    overwrite: bool = False,
    evaluate: EvaluationText | None = None,
    progress: bool = False,
    notify: Notify | None = None,
    resume: bool = False,
    offload_dir: str | os.PathLike | None = None,
) -> QuantizeReport:
    """Quantize `model` (a folder, a `.gguf` file, None for the embedded default) with `config` into `output`.

    `evaluate`: also measure the perplexity of the float model and of the checkpoint as written.
    `overwrite`: replace an existing `output`; the input model is never replaced.
    `resume`: continue an interrupted quantization of the same model with the same config into `output`
    from its last finished block (finished blocks are checked by hash; another model or config is refused).
    `offload_dir`: keep the calibration activations in files there instead of in memory.
    """
    note = notifier(notify)
    output = Path(output).expanduser()
    if model is None:
        note(DEFAULT_MODEL_NOTE)
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    check_output(output, overwrite, source.path)
    offload = Path(offload_dir).expanduser() if offload_dir is not None else None
    return _quantize(source, config, output, overwrite, evaluate, progress, note, resume, offload)


def plan_quantization(model: "str | os.PathLike | ModelSource | None", config: QuantlabConfig) -> "QuantizationPlan":
    """What quantizing `model` with `config` would do, decided on the model built on the meta device: no
    weight is read and nothing is written (`quantlab quantize --plan`)."""
    import torch

    from quantlab.plan import build_plan
    from quantlab.streaming.skeleton import empty_model

    source = model if isinstance(model, ModelSource) else resolve_model(model)
    with open_model(source) as opened:
        opened.refuse_quantized("plan the quantization of its float original instead")
        skeleton = empty_model(opened.model_class, opened.config, torch.float32, opened.folder)  # shapes only
        return build_plan(skeleton, config)


def _quantize(
    source: ModelSource,
    config: QuantlabConfig,
    output: Path,
    overwrite: bool,
    text: EvaluationText | None,
    progress: bool,
    note: Notify,
    resume: bool = False,
    offload_dir: Path | None = None,
) -> QuantizeReport:
    from quantlab.streaming.reader import NotStreamableError

    distributed.init()  # under torchrun: join the other processes before loading
    with open_model(source, scratch=output.parent, progress=progress) as opened:
        _check_quantizable(opened, evaluate=text is not None)
        tokenizer = opened.tokenizer()
        if text is not None and tokenizer is None:
            raise QuantlabError(f"--eval needs a tokenizer, and {source} has none")
        note(f"quantizing {source} with {config!r}")
        if distributed.world_size() > 1:  # each process loads the model; the streamed writer is one process's
            if resume:
                raise QuantlabError("--resume continues a one-process run; rerun without torchrun, or without --resume")
            return _quantize_loaded(opened, config, output, overwrite, text, tokenizer, progress, note)
        try:
            return _quantize_streamed(
                opened, config, output, overwrite, text, tokenizer, progress, note, resume, offload_dir
            )
        except NotStreamableError as error:
            note(f"reading the whole model first: {source} cannot be streamed ({error})")
        return _quantize_loaded(opened, config, output, overwrite, text, tokenizer, progress, note)


def _quantize_streamed(
    opened: OpenedModel,
    config: QuantlabConfig,
    output: Path,
    overwrite: bool,
    text: EvaluationText | None,
    tokenizer: Any,
    progress: bool,
    note: Notify,
    resume: bool,
    offload_dir: Path | None,
) -> QuantizeReport:
    from quantlab.streaming.memory import predict_peak
    from quantlab.streaming.quantize import StreamedQuantization, quantize_checkpoint
    from quantlab.workflows.stats import peak_memory_bytes

    started, memory_before_load = time.perf_counter(), peak_memory_bytes()
    reports: list[QuantizeReport] = []

    def finish(result: StreamedQuantization) -> None:
        quantized_at = time.perf_counter()
        offloaded = offload_dir is not None
        prediction = predict_peak(result.model, result.blocks_name, config, memory_before_load, offloaded)
        report = _report(opened, config, output, result.model, result.folder, started, quantized_at, memory_before_load)
        _add_plan(report, result.plan)
        report.streamed = True
        report.predicted_peak_memory_bytes = prediction.total
        report.predicted_memory_terms = prediction.terms
        _evaluate_and_write(report, result.folder, opened, text, tokenizer, progress, note)
        reports.append(report)

    quantize_checkpoint(
        opened.folder,
        opened.config,
        opened.model_class,
        config,
        output,
        tokenizer=tokenizer,
        resume=resume,
        overwrite=overwrite,
        protect=[opened.source.path],
        before_commit=finish,
        progress=progress,
        note=note,
        offload_dir=offload_dir,
    )
    return reports[0]


def _quantize_loaded(
    opened: OpenedModel,
    config: QuantlabConfig,
    output: Path,
    overwrite: bool,
    text: EvaluationText | None,
    tokenizer: Any,
    progress: bool,
    note: Notify,
) -> QuantizeReport:
    """Quantize while transformers loads the whole model, then save it."""
    from quantlab.saving import save_quantized
    from quantlab.workflows.stats import peak_memory_bytes

    started, memory_before_load = time.perf_counter(), peak_memory_bytes()
    model = opened.load(config)
    quantized_at = time.perf_counter()
    if not distributed.is_main():  # every rank holds the same weights: rank 0 alone writes them
        del model
        return distributed.from_main(None)
    reports: list[QuantizeReport] = []

    def report_and_evaluate(staging: Path) -> None:
        """Runs on the complete checkpoint before it is renamed into place: measured as written."""
        report = _report(opened, config, output, model, staging, started, quantized_at, memory_before_load)
        _add_plan(report, getattr(getattr(model, "hf_quantizer", None), "plan", None))
        _evaluate_and_write(report, staging, opened, text, tokenizer, progress, note)
        reports.append(report)

    save_quantized(
        model, output, tokenizer, overwrite=overwrite, protect=[opened.source.path], before_commit=report_and_evaluate
    )
    return distributed.from_main(reports[0])


def _report(
    opened: OpenedModel,
    config: QuantlabConfig,
    output: Path,
    model: Any,
    staging: Path,
    started: float,
    quantized_at: float,
    memory_before_load: int,
) -> QuantizeReport:
    """The report of the complete checkpoint in `staging` (`model`: the quantized model, or its meta-device shell)."""
    from quantlab.eval.size import stored_bits_per_weight
    from quantlab.workflows.stats import layer_summary, parameter_count, peak_memory_bytes

    source = opened.source
    layers = layer_summary(model)
    if not layers.quantized:
        raise QuantlabError(f"no Linear layer of {source} was quantized; check --modules-to-not-convert")
    return QuantizeReport(
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
        processes=distributed.world_size(),
        padded_groups=layers.padded,
    )


def _add_plan(report: QuantizeReport, plan: "QuantizationPlan | None") -> None:
    if plan is not None:
        report.plan = plan.to_dict()
        report.left_in_float = {weight.name: weight.why for weight in plan.unhandled()}


def _evaluate_and_write(
    report: QuantizeReport,
    staging: Path,
    opened: OpenedModel,
    text: EvaluationText | None,
    tokenizer: Any,
    progress: bool,
    note: Notify,
) -> None:
    """Measure the checkpoint as written (when asked), then write the report beside it: a causal LM's
    perplexity before and after, an encoder's sentence embeddings against the float model's."""
    if text is not None:
        started_evaluation = time.perf_counter()
        if opened.is_causal_lm:
            report.evaluation_text = text.describe()
            note(f"measuring perplexity on {report.evaluation_text}")
            report.perplexity_after = reloaded_perplexity(staging, text, tokenizer, progress)
            report.perplexity_before = reloaded_perplexity(opened.folder, text, tokenizer, progress)
        else:
            from quantlab.calibration.data import ENCODER_EVAL_LINES

            note(f"measuring sentence embeddings against the float model's on the first {ENCODER_EVAL_LINES} "
                 f"non-empty lines of {text.source}")  # fmt: skip
            cosines = reloaded_embedding_cosines(staging, opened.folder, text, tokenizer)
            report.evaluation_text = f"the first {len(cosines)} non-empty lines of {text.source}"
            report.embedding_cosine_mean = float(cosines.mean())
            report.embedding_cosine_worst = float(cosines.min())
        report.evaluate_seconds = time.perf_counter() - started_evaluation
    (staging / REPORT_FILE).write_text(report_json(asdict(report)), encoding="utf-8")


def _check_quantizable(opened: OpenedModel, evaluate: bool) -> None:
    opened.refuse_quantized("quantize its float original instead")
    if evaluate and not (opened.is_causal_lm or opened.is_text_encoder):
        raise QuantlabError(
            f"--eval measures a causal language model's perplexity or a text encoder's sentence embeddings, but "
            f"{opened.source} is a {opened.model_class.__name__}; quantize it without --eval"
        )
