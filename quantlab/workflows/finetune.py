"""QLoRA: LoRA adapters trained on a quantized (or float) base with transformers' Trainer.

The base is quantized while it loads (`quantization`, any registered method's config), loaded
as it was saved (an already quantized checkpoint), quantized by bitsandbytes (`bitsandbytes=True`,
NF4 with double quantization, for comparison) or kept in float. The adapters train on the run's
text (the bundled WikiText-2 text after its evaluation windows by default), with held-out
perplexity measured before and after. The run folder holds `trainer_state.json` (the log),
`checkpoint-N`, `final/` (the adapter, in PEFT's format), `merged/` (with `merge`) and the
report. Under `torchrun` or `accelerate launch` (DDP; gloo on CPU) only the first process writes
the report; the others return None.
"""

import os
from dataclasses import asdict, dataclass
from typing import Any, Literal

from quantlab.config import QuantlabConfig
from quantlab.errors import QuantlabError
from quantlab.loading import ModelSource, OpenedModel, open_model, resolve_model
from quantlab.workflows.notes import Notify, notifier
from quantlab.workflows.outputs import write_report
from quantlab.workflows.runs import TrainingRun

BITSANDBYTES_BASE = "bitsandbytes NF4 (double quantization, blocksize 64)"


class FinetuneError(QuantlabError, ValueError):
    """Fine-tuning options that contradict each other or cannot apply to the model."""


@dataclass(frozen=True)
class LoraOptions:
    """The adapters: rank, scaling numerator (None: 2 x r), dropout, the layers adapted, and QA-LoRA's
    input runs (None: plain LoRA; a group size: `A` reads each run of that many inputs averaged, so the
    adapter merges into the base's zero points, `quantlab.integrations.peft.lora`)."""

    r: int = 16
    alpha: float | None = None
    dropout: float = 0.05
    target_modules: str | list[str] = "all-linear"
    qalora_group_size: int | None = None

    def validate(self) -> None:
        if self.r < 1:
            raise FinetuneError("--lora-r must be at least 1")
        if self.qalora_group_size is not None and self.qalora_group_size < 1:
            raise FinetuneError("--qa-lora takes a group size of at least 1, e.g. the base's --group-size")


@dataclass
class FinetuneReport:
    """What a fine-tuning run did, as saved in the run folder's `quantlab_report.json`."""

    model: str
    base: str
    output: str
    steps: int
    processes: int
    lora_r: int
    trainable_parameters: int
    loss_first: float | None
    loss_last: float | None
    perplexity_before: float | None
    perplexity_after: float | None
    seconds_per_step: float | None
    tokens_per_second: float | None
    peak_memory_mib: float
    optimizer_state_mib: float
    adapter: str
    merge: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def finetune(
    model: "str | os.PathLike | ModelSource | None",
    run: TrainingRun,
    *,
    quantization: QuantlabConfig | None = None,
    bitsandbytes: bool = False,
    lora: LoraOptions = LoraOptions(),
    merge: Literal["quantized", "float"] | None = None,
    progress: bool = False,
    notify: Notify | None = None,
) -> FinetuneReport | None:
    """Train LoRA adapters on `model` for `run.max_steps` steps; the report (None on processes but the first)."""
    run.validate(steps_required=True)
    lora.validate()
    if quantization is not None and bitsandbytes:
        raise FinetuneError("--method quantizes with quantlab, --bitsandbytes with bitsandbytes: pass one of them")
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    output = run.prepare([source.path])
    with open_model(source, scratch=output.parent, progress=progress) as opened:
        base_model, tokenizer, base = _load_base(opened, quantization, bitsandbytes)
        return _train(base_model, tokenizer, base, str(source), run, lora, merge, progress, notifier(notify))


def _load_base(opened: OpenedModel, quantization: Any, bitsandbytes: bool) -> tuple[Any, Any, str]:
    """The base model and its tokenizer, quantized as asked (then k-bit ready), and how its weights are held."""
    import torch
    from peft import prepare_model_for_kbit_training

    source, saved = opened.source, opened.quantization
    if not opened.is_causal_lm:
        raise FinetuneError(
            f"{source} is a {opened.model_class.__name__}, not a causal language model; finetune trains LMs"
        )
    tokenizer = opened.tokenizer()
    if tokenizer is None:
        raise FinetuneError(f"{source} has no tokenizer, which training needs; save one beside the model")
    if quantization is not None or bitsandbytes:
        opened.refuse_quantized(
            "drop --method/--bitsandbytes to train on it as saved, or start from a float checkpoint"
        )
    if bitsandbytes:
        quantization, base = _bitsandbytes_nf4(), BITSANDBYTES_BASE
    else:
        base = f"{quantization.method} ({quantization!r})" if quantization is not None else saved or "float32"
    model = opened.load(quantization, dtype=torch.float32)
    if quantization is not None or saved is not None:
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # Trainer turns checkpointing on
    return model, tokenizer, base


def _bitsandbytes_nf4() -> Any:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise FinetuneError("--bitsandbytes needs bitsandbytes: pip install 'quantlab[compare]'") from error
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


def _train(
    model: Any,
    tokenizer: Any,
    base: str,
    name: str,
    run: TrainingRun,
    lora: LoraOptions,
    merge: str | None,
    progress: bool,
    note: Notify,
) -> FinetuneReport | None:
    from transformers import set_seed

    from quantlab.training import CausalLMCollator, Trainer, add_lora, trainable_parameters
    from quantlab.workflows.stats import peak_memory_bytes

    output = run.output_dir
    targets = lora.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        targets = targets.split(",")
    alpha = lora.alpha if lora.alpha is not None else 2 * lora.r
    set_seed(run.seed)  # the adapters' initialization too is part of a reproducible run
    qalora = {"use_qalora": True, "qalora_group_size": lora.qalora_group_size} if lora.qalora_group_size else {}
    model = add_lora(model, r=lora.r, alpha=alpha, dropout=lora.dropout, target_modules=targets, **qalora)
    data = run.training_data(tokenizer)
    evaluate = bool(run.eval_windows)
    eval_steps = (run.eval_steps or run.max_steps) if evaluate else 0
    training_args = run.training_arguments(progress, eval_steps=eval_steps, eval_on_start=evaluate)
    collator = CausalLMCollator.for_tokenizer(tokenizer)
    trainer = Trainer(model, training_args, data.train, eval_windows=data.eval_windows, data_collator=collator)
    result = trainer.train(resume_from_checkpoint=run.resume_from_checkpoint)
    if not trainer.is_world_process_zero():
        return None
    log = trainer.state.log_history  # what train() wrote to trainer_state.json
    losses = [record["loss"] for record in log if "loss" in record]
    perplexities = [record["eval_perplexity"] for record in log if "eval_perplexity" in record]
    runtime = next((record["train_runtime"] for record in reversed(log) if "train_runtime" in record), None)
    tokens = trainer.state.num_input_tokens_seen - getattr(trainer, "_initial_num_input_tokens_seen", 0)
    states = getattr(trainer.optimizer, "optimizer", trainer.optimizer).state.values()
    optimizer_bytes = sum(v.numel() * v.element_size() for s in states for v in s.values() if hasattr(v, "numel"))
    report = FinetuneReport(
        model=name,
        base=base,
        output=str(output),
        steps=result.global_step,
        processes=trainer.args.world_size,
        lora_r=lora.r,
        trainable_parameters=sum(p.numel() for p in trainable_parameters(model).values()),
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        perplexity_before=perplexities[0] if len(perplexities) > 1 else None,
        perplexity_after=perplexities[-1] if len(perplexities) > 1 else None,
        seconds_per_step=runtime / max(len(losses), 1) if runtime else None,
        tokens_per_second=tokens / runtime if runtime else None,
        peak_memory_mib=peak_memory_bytes() / 2**20,
        optimizer_state_mib=optimizer_bytes / 2**20,
        adapter=str(output / "final"),
    )
    if merge:
        trained = trainer.accelerator.unwrap_model(trainer.model)
        report.merge = _merge(trained, tokenizer, run, merge, note)
    write_report(output, report.as_dict())
    return report


def _merge(model: Any, tokenizer: Any, run: TrainingRun, mode: str, note: Notify) -> dict[str, Any]:
    """Merge the adapter, measure the perplexity it costs on the held-out windows, save the merged model."""
    from quantlab.assets.text import bundled_text
    from quantlab.saving import save_model
    from quantlab.training import merge_adapter

    note(f"merging the adapter ({mode}) and measuring its perplexity change")
    documents = run.documents()
    text = "\n".join(documents) if documents else bundled_text()
    windows = max(run.eval_windows, 1)
    merged, report = merge_adapter(model, tokenizer, text, mode=mode, seq_len=run.eval_seq_len, windows=windows)
    save_model(merged, tokenizer, run.output_dir / "merged")
    return {**report, "path": str(run.output_dir / "merged")}
