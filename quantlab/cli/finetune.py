"""`quantlab finetune [MODEL] --method NAME [method options] --max-steps N --output-dir DIR`: QLoRA.

The base is quantized while it loads (`--method`, any registered method), loaded as it was
saved (an already quantized checkpoint), quantized by bitsandbytes (`--bitsandbytes`, NF4 with
double quantization, for comparison) or kept in float (no `--method`: plain LoRA). LoRA adapters
train on the bundled WikiText-2 text after its evaluation windows, or on `--data FILE`, with
held-out perplexity measured before and after. DIR is the run folder: `trainer_state.json`
(the log), `checkpoint-N`, `final/` (the adapter, in PEFT's format), `merged/` (with `--merge`) and the
report. The same command runs under `torchrun` or `accelerate launch` (DDP; gloo on CPU); only
the first process prints and writes.
"""

import argparse
from pathlib import Path
from typing import Any

from quantlab.cli.console import Console, add_output_options, seconds
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
from quantlab.cli.training_flags import (
    add_training_flags,
    finish_run,
    prepare_run_folder,
    resolve_training_flags,
    training_arguments,
    training_data,
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
    lora.add_argument("--target-modules", default="all-linear", metavar="A,B,...",
                      help="layer names to adapt, comma-separated (default: all-linear, every projection)")  # fmt: skip
    lora.add_argument("--merge", choices=("quantized", "float"), help="merge the adapter at the end, and report")
    add_training_flags(parser)
    add_output_options(parser)


def run(args: argparse.Namespace) -> int:
    console = Console.from_args(args)
    resolve_training_flags(args, "finetune")
    if args.lora_r < 1:
        raise QuantlabError("--lora-r must be at least 1")
    if args.method and args.bitsandbytes:
        raise QuantlabError("--method quantizes with quantlab, --bitsandbytes with bitsandbytes: pass one of them")
    quantization = config_from_args(args) if args.method else None
    source = resolve_model(args.model)
    output = prepare_run_folder(args, [source.path])
    with float_checkpoint(source, scratch=output.parent, progress=console.progress) as folder:
        model, tokenizer, base = _load_base(folder, source, quantization, args)
        _train(model, tokenizer, base, str(source), output, args, console)
    return 0


def _load_base(folder: Path, source: Any, quantization: Any, args: argparse.Namespace) -> tuple[Any, Any, str]:
    """The base model and its tokenizer, quantized as asked (then k-bit ready), and how its weights are held."""
    import torch
    from peft import prepare_model_for_kbit_training

    config = read_config(folder)
    cls, saved = model_class(config), quantization_method_of(config)
    if not is_causal_lm(cls):
        raise QuantlabError(f"{source} is a {cls.__name__}, not a causal language model; finetune trains LMs")
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        raise QuantlabError(f"{source} has no tokenizer, which training needs; save one beside the model")
    if saved is not None and (quantization is not None or args.bitsandbytes):
        raise QuantlabError(f"{folder} is already quantized ({saved}); drop --method/--bitsandbytes to train on it "
                            f"as saved, or start from a float checkpoint")  # fmt: skip
    if args.bitsandbytes:
        quantization, base = _bitsandbytes_nf4(), "bitsandbytes NF4 (double quantization, blocksize 64)"
    else:
        base = f"{quantization.method} ({quantization!r})" if quantization is not None else saved or "float32"
    model = load_model(folder, cls, dtype=torch.float32, quantization_config=quantization)
    if quantization is not None or saved is not None:
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # Trainer turns checkpointing on
    return model, tokenizer, base


def _bitsandbytes_nf4() -> Any:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise QuantlabError("--bitsandbytes needs bitsandbytes: pip install 'quantlab[compare]'") from error
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


def _train(model: Any, tokenizer: Any, base: str, name: str, output: Path, args: Any, console: Console) -> None:
    from transformers import set_seed

    from quantlab.cli.stats import peak_memory_bytes
    from quantlab.training import CausalLMCollator, Trainer, add_lora, trainable_parameters

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
        return
    log = trainer.state.log_history  # what train() wrote to trainer_state.json
    losses = [r["loss"] for r in log if "loss" in r]
    perplexities = [r["eval_perplexity"] for r in log if "eval_perplexity" in r]
    runtime = next((r["train_runtime"] for r in reversed(log) if "train_runtime" in r), None)
    tokens = trainer.state.num_input_tokens_seen - getattr(trainer, "_initial_num_input_tokens_seen", 0)
    states = getattr(trainer.optimizer, "optimizer", trainer.optimizer).state.values()
    optimizer_bytes = sum(v.numel() * v.element_size() for s in states for v in s.values() if hasattr(v, "numel"))
    report = {
        "model": name, "base": base, "output": str(output), "steps": result.global_step,
        "processes": trainer.args.world_size, "lora_r": args.lora_r,
        "trainable_parameters": sum(p.numel() for p in trainable_parameters(model).values()),
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "perplexity_before": perplexities[0] if len(perplexities) > 1 else None,
        "perplexity_after": perplexities[-1] if len(perplexities) > 1 else None,
        "seconds_per_step": runtime / max(len(losses), 1) if runtime else None,
        "tokens_per_second": tokens / runtime if runtime else None,
        "peak_memory_mib": peak_memory_bytes() / 2**20, "optimizer_state_mib": optimizer_bytes / 2**20,
        "adapter": str(output / "final"), "merge": None,
    }  # fmt: skip
    rows = [
        ("base", base),
        ("adapters", f"LoRA r={args.lora_r}, {report['trainable_parameters']:,} trainable parameters"),
        ("training", f"{result.global_step} steps on {trainer.args.world_size} process(es)"),
    ]
    if losses:
        rows.append(("loss", f"{losses[0]:.4f} -> {losses[-1]:.4f}"))
    if report["perplexity_before"] is not None:
        before, after = report["perplexity_before"], report["perplexity_after"]
        rows.append(("held-out perplexity", f"{before:.3f} -> {after:.3f} ({100 * (after / before - 1):+.1f} %)"))
    if runtime:
        speed = f"{seconds(report['seconds_per_step'])}/step, {report['tokens_per_second']:.0f} tokens/s"
        rows.append(("speed", speed))
    rows.append(("peak memory", f"{report['peak_memory_mib']:.0f} MiB (process peak)"))
    rows.append(("optimizer state", f"{report['optimizer_state_mib']:.2f} MiB"))
    if args.merge:
        trained = trainer.accelerator.unwrap_model(trainer.model)
        merge = report["merge"] = _merge(trained, tokenizer, output, args, console)
        rows.append((f"merge ({args.merge})", f"perplexity {merge['perplexity_adapter']:.3f} -> "
                     f"{merge['perplexity_merged']:.3f} ({100 * merge['perplexity_change']:+.2f} %), max logit change "
                     f"{merge['max_logit_difference']:.2e} -> {merge['path']}"))  # fmt: skip
    finish_run(console, output, f"fine-tuned {name} -> {output}", rows, report)


def _merge(model: Any, tokenizer: Any, output: Path, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Merge the adapter, measure the perplexity it costs on the held-out windows, save the merged model."""
    from quantlab.eval.data import bundled_text
    from quantlab.saving import save_model
    from quantlab.training import merge_adapter, read_documents

    console.note(f"merging the adapter ({args.merge}) and measuring its perplexity change")
    data = args.data and read_documents(Path(args.data).expanduser(), text_field=args.text_field)
    text = "\n".join(data) if data else bundled_text()
    windows = max(args.eval_windows, 1)
    merged, report = merge_adapter(model, tokenizer, text, mode=args.merge, seq_len=args.eval_seq_len, windows=windows)
    save_model(merged, tokenizer, output / "merged")
    return {**report, "path": str(output / "merged")}
