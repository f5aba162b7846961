"""`quantlab finetune [MODEL] --method NAME [method options] --steps N --output DIR`: QLoRA on the shared loop.

The base is quantized while it loads (`--method`, any registered method), loaded as it was
saved (an already quantized checkpoint), quantized by bitsandbytes (`--bitsandbytes`, NF4 with
double quantization, for comparison) or kept in float (no `--method`: plain LoRA). LoRA adapters
train on the bundled WikiText-2 text after its evaluation windows, or on `--data FILE`
(.txt or .jsonl), with held-out perplexity measured before and after.

DIR is the run folder: `log.jsonl`, `checkpoints/step-N` (with `--save-every`), `final/` (the
adapter, in PEFT's format), `merged/` (with `--merge quantized|float`) and the report. The same
command runs under `torchrun --nproc_per_node 2` or `accelerate launch` (DDP; gloo on CPU); only
the first process prints and writes.
"""

import argparse
import dataclasses
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

from quantlab.cli.console import Console, add_output_options, key_value_table, seconds
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
    train_run,
)
from quantlab.cli.options import add_method_argument, config_from_args
from quantlab.cli.output import write_report
from quantlab.errors import QuantlabError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from quantlab.training import optimizer_names
    from quantlab.training.config import PRECISIONS, SCHEDULES

    parser = subparsers.add_parser(
        "finetune",
        help="train LoRA adapters on a quantized (QLoRA) or float model",
        description="QLoRA fine-tuning on the shared training loop. Method options come from the method's "
        "config: add --method NAME to --help to list them. Without --method (and --bitsandbytes) the base "
        "stays in float.",
    )
    add_model_argument(parser, help="model folder or .gguf file (default: embedded SmolLM2-135M)")
    add_method_argument(parser, required=False)
    parser.add_argument("--bitsandbytes", action="store_true", help="quantize the base with bitsandbytes NF4 instead")
    parser.add_argument("--steps", type=int, required=True, metavar="N", help="optimizer steps")
    parser.add_argument("--output", "-o", required=True, metavar="DIR", help="run folder (log, checkpoints, adapter)")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing DIR and start a new run in it")

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

    training = parser.add_argument_group("training")
    training.add_argument("--batch-size", type=int, default=4, metavar="N", help="examples per micro-batch (default 4)")
    training.add_argument("--grad-accum", type=int, default=1, metavar="K", help="micro-batches per step (default 1)")
    training.add_argument("--seq-len", type=int, default=256, metavar="N", help="tokens per example (default 256)")
    training.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (default 2e-4)")
    training.add_argument("--schedule", default="linear", choices=SCHEDULES, help="(default: linear)")
    training.add_argument("--warmup-ratio", type=float, default=0.0, metavar="F", help="(default: 0)")
    training.add_argument("--warmup-steps", type=int, default=0, metavar="N", help="(default: 0)")
    training.add_argument("--weight-decay", type=float, default=0.0, help="(default: 0)")
    training.add_argument("--max-grad-norm", type=float, default=1.0, help="clip norm, 0 to turn off (default 1)")
    training.add_argument("--optim", default="adamw_torch", choices=optimizer_names(), help="(default: adamw_torch)")
    training.add_argument("--precision", default="fp32", choices=PRECISIONS, help="(default: fp32)")
    training.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="recompute activations in the backward pass (default: on)",
    )
    training.add_argument("--compile", action="store_true", help="torch.compile the model")
    training.add_argument("--seed", type=int, default=0, help="(default: 0)")
    training.add_argument("--data", metavar="FILE", help="training text, .txt or .jsonl (default: bundled text)")
    training.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")

    run = parser.add_argument_group("evaluation, checkpoints, logging")
    run.add_argument("--eval-windows", type=int, default=4, metavar="N", help="held-out windows (default 4)")
    run.add_argument("--eval-seq-len", type=int, default=512, metavar="N", help="tokens per window (default 512)")
    run.add_argument("--eval-every", type=int, default=0, metavar="N", help="(default: only before and after)")
    run.add_argument("--save-every", type=int, default=0, metavar="N", help="checkpoint every N steps (default: off)")
    run.add_argument("--keep-last", type=int, default=2, metavar="K", help="checkpoints kept (default 2)")
    run.add_argument("--resume", metavar="latest|DIR", help="continue from the latest checkpoint of DIR, or DIR")
    run.add_argument("--log-every", type=int, default=1, metavar="N", help="(default: 1)")
    run.add_argument("--empty-cache-every", type=int, default=0, metavar="N", help="(default: off)")
    run.add_argument("--profile-steps", metavar="START:STOP", help="torch.profiler trace of these steps")
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
        if self.seconds_per_step is not None:
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
    _check_arguments(args)
    quantization = config_from_args(args) if args.method else None
    output = Path(args.output).expanduser()
    source = resolve_model(args.model)
    _prepare_output(output, args, source)
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
    if args.steps < 1:
        raise QuantlabError("--steps must be at least 1")
    if args.lora_r < 1:
        raise QuantlabError("--lora-r must be at least 1")
    if args.method and args.bitsandbytes:
        raise QuantlabError("--method quantizes with quantlab, --bitsandbytes with bitsandbytes: pass one of them")
    if args.data is not None and not Path(args.data).expanduser().is_file():
        raise QuantlabError(f"--data {args.data}: no such file")
    if args.eval_windows < 0:
        raise QuantlabError("--eval-windows must be 0 (no evaluation) or more")


def _prepare_output(output: Path, args: argparse.Namespace, source: Any) -> None:
    """The run folder: continued with --resume, replaced with --overwrite, otherwise it must be new."""
    from quantlab.utils.atomic import OutputExistsError, check_replaceable, make_staging

    if output.exists() and not output.is_dir():
        raise QuantlabError(f"--output {output} is a file; finetune writes a run folder there, so pick a folder path")
    if args.resume or not output.exists():
        return
    if not args.overwrite:
        raise OutputExistsError(
            f"output {output} already exists; pass --resume latest to continue its run, --overwrite to replace it, "
            f"or pick another"
        )
    inputs = [source.path] + ([Path(args.data).expanduser()] if args.data else [])
    check_replaceable(output, overwrite=True, protect=inputs)
    if _is_main_process():
        retired = make_staging(output.parent, output.name, "old")
        os.replace(output, retired / output.name)
        shutil.rmtree(retired, ignore_errors=True)


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _load_base(folder: Path, cls: type, config: Any, quantization: Any, args: argparse.Namespace):
    """The base model, quantized as asked, prepared for k-bit training when it is quantized."""
    import torch

    from quantlab.training import prepare_for_kbit_training

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
        prepare_for_kbit_training(model, activation_checkpointing=args.activation_checkpointing)
    else:
        model.requires_grad_(False)
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
    from accelerate.utils import set_seed

    from quantlab.training import CausalLMCollator, Trainer, add_lora
    from quantlab.training.checkpoint import trainable_parameters
    from quantlab.training.reporting import read_log

    targets = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
    alpha = args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r
    set_seed(args.seed)  # the adapters' initialization too is part of a reproducible run
    model = add_lora(model, r=args.lora_r, alpha=alpha, dropout=args.lora_dropout, target_modules=targets)
    data = _training_data(tokenizer, args)
    trainer = Trainer(
        model,
        _training_config(args, output, console),
        data.train,
        eval_windows=data.eval_windows,
        collator=CausalLMCollator.for_tokenizer(tokenizer),
    )
    result = train_run(trainer)
    if not trainer.accelerator.is_main_process:
        return None
    log = read_log(output)
    steps = [r for r in log if "loss" in r]
    evaluations = [r["eval_perplexity"] for r in log if "eval_perplexity" in r]
    timed = [r["seconds_per_step"] for r in steps[1:]] or [r["seconds_per_step"] for r in steps]
    report = FinetuneReport(
        model=name,
        base=base,
        output=str(output),
        steps=result.steps,
        processes=trainer.accelerator.num_processes,
        lora_r=args.lora_r,
        trainable_parameters=sum(p.numel() for p in trainable_parameters(model).values()),
        loss_first=steps[0]["loss"] if steps else None,
        loss_last=steps[-1]["loss"] if steps else None,
        perplexity_before=evaluations[0] if len(evaluations) > 1 else None,
        perplexity_after=evaluations[-1] if len(evaluations) > 1 else None,
        seconds_per_step=statistics.median(timed) if timed else None,
        tokens_per_second=statistics.median(r["tokens_per_second"] for r in steps) if steps else None,
        peak_memory_mib=result.peak_memory_mib,
        optimizer_state_mib=steps[-1]["optimizer_state_mib"] if steps else None,
        adapter=str(result.final_dir) if result.final_dir else None,
    )
    if args.merge:
        report.merge = _merge(trainer.accelerator.unwrap_model(trainer.model), tokenizer, output, args, console)
    write_report(output, dataclasses.asdict(report))
    return report


def _training_config(args: argparse.Namespace, output: Path, console: Console):
    from quantlab.training import TrainingConfig

    profile = None
    if args.profile_steps:
        try:
            start, stop = (int(part) for part in args.profile_steps.split(":"))
        except ValueError as error:
            raise QuantlabError(f"--profile-steps {args.profile_steps!r}: write START:STOP, e.g. 2:4") from error
        profile = (start, stop)
    return TrainingConfig(
        output,
        max_steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        optim=args.optim,
        lr_scheduler=args.schedule,
        warmup_steps=args.warmup_steps,
        warmup_ratio=args.warmup_ratio,
        max_grad_norm=args.max_grad_norm or None,
        precision=args.precision,
        activation_checkpointing=args.activation_checkpointing,
        compile=args.compile,
        empty_cache_every=args.empty_cache_every,
        profile_steps=profile,
        eval_every=(args.eval_every or args.steps) if args.eval_windows else 0,
        log_every=args.log_every,
        save_every=args.save_every,
        keep_last=args.keep_last,
        resume_from=args.resume,
        seed=args.seed,
        progress_bar=console.progress,
    )


def _training_data(tokenizer: Any, args: argparse.Namespace):
    from quantlab.training import bundled_data, causal_lm_data, read_documents

    windows = {"eval_windows": args.eval_windows, "eval_seq_len": args.eval_seq_len}
    if args.data is None:
        return bundled_data(tokenizer, seq_len=args.seq_len, **windows)
    documents = read_documents(Path(args.data).expanduser(), text_field=args.text_field)
    return causal_lm_data(tokenizer, documents, seq_len=args.seq_len, **windows)


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
