"""`quantlab finetune [MODEL] --method NAME [method options] --max-steps N --output-dir DIR`: QLoRA.

The base is quantized while it loads (`--method`, any registered method), loaded as it was
saved (an already quantized checkpoint), quantized by bitsandbytes (`--bitsandbytes`, NF4 with
double quantization, for comparison) or kept in float (no `--method`: plain LoRA). LoRA adapters
train on the bundled WikiText-2 text after its evaluation windows, or on `--data FILE`
(.txt or .jsonl), with held-out perplexity measured before and after.

DIR is the run folder: `log.jsonl`, `checkpoint-N` (with `--save-steps`), `final/` (the
adapter, in PEFT's format), `merged/` (with `--merge quantized|float`) and the report. The
training flags are shared with `prune` and `distill` (`quantlab.cli.training_flags`). The same
command runs under `torchrun --nproc_per_node 2` or `accelerate launch` (DDP; gloo on CPU); only
the first process prints and writes.
"""

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from quantlab.cli.console import Console, add_output_options, key_value_table, seconds
from quantlab.cli.distill import training_data
from quantlab.cli.models import (
    add_model_argument,
    float_checkpoint,
    is_causal_lm,
    load_model,
    load_tokenizer,
    model_class,
    quantization_method_of,
    read_config,
    resolve_model,
)
from quantlab.cli.options import add_method_argument, config_from_args
from quantlab.cli.output import write_report
from quantlab.cli.training_flags import (
    add_training_flags,
    check_training_values,
    prepare_run_folder,
    resolve_training_flags,
    training_arguments,
)
from quantlab.errors import QuantlabError


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
    lora.add_argument("--lora-alpha", type=float, metavar="A", help="scaling numerator (default: 2 x r)")
    lora.add_argument("--lora-dropout", type=float, default=0.05, metavar="P", help="(default: 0.05)")
    lora.add_argument(
        "--target-modules",
        default="all-linear",
        metavar="A,B,...",
        help="layer names to adapt, comma-separated (default: all-linear, every projection)",
    )
    lora.add_argument("--merge", choices=("quantized", "float"), help="merge the adapter at the end, and report")

    add_training_flags(parser)
    add_output_options(parser)


@dataclasses.dataclass
class FinetuneReport:
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
    optimizer_state_mib: float | None
    adapter: str | None
    merge: dict[str, Any] | None = None

    def as_table(self) -> str:
        rows = [
            ("base", self.base),
            ("adapters", f"LoRA r={self.lora_r}, {self.trainable_parameters:,} trainable parameters"),
            ("training", f"{self.steps} steps on {self.processes} process(es)"),
        ]
        if self.loss_first is not None:
            rows.append(("loss", f"{self.loss_first:.4f} -> {self.loss_last:.4f}"))
        if self.perplexity_before is not None and self.perplexity_after is not None:
            change = 100 * (self.perplexity_after / self.perplexity_before - 1)
            perplexity = f"{self.perplexity_before:.3f} -> {self.perplexity_after:.3f} ({change:+.1f} %)"
            rows.append(("held-out perplexity", perplexity))
        if self.seconds_per_step is not None and self.tokens_per_second is not None:
            rows.append(("speed", f"{seconds(self.seconds_per_step)}/step, {self.tokens_per_second:.0f} tokens/s"))
        rows.append(("peak memory", f"{self.peak_memory_mib:.0f} MiB (process peak)"))
        if self.optimizer_state_mib is not None:
            rows.append(("optimizer state", f"{self.optimizer_state_mib:.2f} MiB"))
        if self.merge is not None:
            rows.append(
                (
                    f"merge ({self.merge['mode']})",
                    f"perplexity {self.merge['perplexity_adapter']:.3f} -> {self.merge['perplexity_merged']:.3f} "
                    f"({100 * self.merge['perplexity_change']:+.2f} %), max logit change "
                    f"{self.merge['max_logit_difference']:.2e} -> {self.merge['path']}",
                )
            )
        return key_value_table(f"fine-tuned {self.model} -> {self.output}", rows)


def run(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    resolve_training_flags(args, "finetune")
    _check_arguments(args)
    quantization = config_from_args(args) if args.method else None
    output = Path(args.output_dir).expanduser()
    source = resolve_model(args.model)
    prepare_run_folder(output, args, [source.path] + ([Path(args.data).expanduser()] if args.data else []))
    with float_checkpoint(source, scratch=output.parent, progress=console.progress) as folder:
        config = read_config(folder)
        cls = model_class(config)
        if not is_causal_lm(cls):
            raise QuantlabError(f"{source} is a {cls.__name__}, not a causal language model; finetune trains LMs")
        tokenizer = load_tokenizer(folder)
        if tokenizer is None:
            raise QuantlabError(f"{source} has no tokenizer, which training needs; save one beside the model")
        model, base = _load_base(folder, cls, config, quantization, args)
        report = _train(model, tokenizer, base, str(source), output, args, console)
    if report is not None:
        console.report(report.as_table(), dataclasses.asdict(report))
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    check_training_values(args, steps_required=True)
    if args.lora_r < 1:
        raise QuantlabError("--lora-r must be at least 1")
    if args.method and args.bitsandbytes:
        raise QuantlabError("--method quantizes with quantlab, --bitsandbytes with bitsandbytes: pass one of them")


def _load_base(folder: Path, cls: type, config: Any, quantization: Any, args: argparse.Namespace):
    """The base model, quantized as asked, prepared for k-bit training when it is quantized."""
    import torch
    from peft import prepare_model_for_kbit_training

    saved_method = quantization_method_of(config)
    if saved_method is not None and (quantization is not None or args.bitsandbytes):
        raise QuantlabError(
            f"{folder} is already quantized ({saved_method}); drop --method/--bitsandbytes to train on it as saved, "
            f"or start from a float checkpoint"
        )
    options: dict[str, Any] = {"dtype": torch.float32}
    if quantization is not None:
        options["quantization_config"] = quantization
        base = f"{quantization.method} ({quantization!r})"
    elif args.bitsandbytes:
        options["quantization_config"] = _bitsandbytes_nf4()
        base = "bitsandbytes NF4 (double quantization, blocksize 64)"
    else:
        base = saved_method or "float32"
    model = load_model(folder, cls, **options)
    if quantization is not None or args.bitsandbytes or saved_method is not None:
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # Trainer turns checkpointing on
    return model, base


def _bitsandbytes_nf4() -> Any:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise QuantlabError("--bitsandbytes needs bitsandbytes: pip install 'quantlab[compare]'") from error
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


def _train(
    model: Any, tokenizer: Any, base: str, name: str, output: Path, args: argparse.Namespace, console: Console
) -> FinetuneReport | None:
    from transformers import set_seed

    from quantlab.training import CausalLMCollator, Trainer, add_lora, read_log, trainable_parameters
    from quantlab.training.reporting import MIB, peak_memory_bytes

    targets = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
    alpha = args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r
    set_seed(args.seed)  # the adapters' initialization too is part of a reproducible run
    model = add_lora(model, r=args.lora_r, alpha=alpha, dropout=args.lora_dropout, target_modules=targets)
    data = training_data(args, tokenizer)
    evaluate = bool(args.eval_windows)
    eval_steps = (args.eval_steps or args.max_steps) if evaluate else 0
    training_args = training_arguments(args, console, eval_steps=eval_steps, eval_on_start=evaluate)
    collator = CausalLMCollator.for_tokenizer(tokenizer)
    trainer = Trainer(model, training_args, data.train, eval_windows=data.eval_windows, data_collator=collator)
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if not trainer.is_world_process_zero():
        return None
    log = read_log(output)
    steps = [r for r in log if "loss" in r]
    evaluations = [r["eval_perplexity"] for r in log if "eval_perplexity" in r]
    summary = next((r for r in reversed(log) if "train_runtime" in r), {})
    trained = max(len(steps), 1)
    report = FinetuneReport(
        model=name,
        base=base,
        output=str(output),
        steps=result.global_step,
        processes=trainer.args.world_size,
        lora_r=args.lora_r,
        trainable_parameters=sum(p.numel() for p in trainable_parameters(model).values()),
        loss_first=steps[0]["loss"] if steps else None,
        loss_last=steps[-1]["loss"] if steps else None,
        perplexity_before=evaluations[0] if len(evaluations) > 1 else None,
        perplexity_after=evaluations[-1] if len(evaluations) > 1 else None,
        seconds_per_step=summary["train_runtime"] / trained if summary else None,
        tokens_per_second=_tokens_per_second(trainer, summary),
        peak_memory_mib=peak_memory_bytes(trainer.args.device) / MIB,
        optimizer_state_mib=_state_bytes(trainer.optimizer) / MIB,
        adapter=str(output / "final"),
    )
    if args.merge:
        report.merge = _merge(trainer.accelerator.unwrap_model(trainer.model), tokenizer, output, args, console)
    write_report(output, dataclasses.asdict(report))
    return report


def _tokens_per_second(trainer: Any, summary: dict[str, Any]) -> float | None:
    """Tokens (not padding) this session trained on, per second of its run time."""
    tokens = trainer.state.num_input_tokens_seen - getattr(trainer, "_initial_num_input_tokens_seen", 0)
    return tokens / summary["train_runtime"] if summary.get("train_runtime") else None


def _state_bytes(optimizer: Any) -> int:
    states = getattr(optimizer, "optimizer", optimizer).state.values()
    return sum(v.numel() * v.element_size() for state in states for v in state.values() if hasattr(v, "numel"))


def _merge(model: Any, tokenizer: Any, output: Path, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Merge the adapter, measure the perplexity it costs on the held-out windows, save the merged model."""
    from quantlab.cli.models import save_checkpoint
    from quantlab.training import merge_adapter, read_documents
    from quantlab.utils.atomic import atomic_directory

    console.note(f"merging the adapter ({args.merge}) and measuring its perplexity change")
    if args.data is None:
        from quantlab.eval.data import bundled_text

        text = bundled_text()
    else:
        text = "\n".join(read_documents(Path(args.data).expanduser(), text_field=args.text_field))
    windows = max(args.eval_windows, 1)
    merged, report = merge_adapter(model, tokenizer, text, mode=args.merge, seq_len=args.eval_seq_len, windows=windows)
    path = output / "merged"
    with atomic_directory(path, overwrite=True) as staging:
        save_checkpoint(merged, tokenizer, staging)
    return {**report.to_dict(), "path": str(path)}
