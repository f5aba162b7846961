"""Training on SmolLM2-135M: fp32 LoRA against quantlab NF4 / 4-bit QLoRA and bitsandbytes NF4 QLoRA.

    python benchmarks/training.py --json training.json          # everything, about an hour on 2 cores
    python benchmarks/training.py --phases memory --repeats 2   # one phase

Every configuration: batch 4 x 256 tokens of the bundled WikiText-2 text after its 16 x 512
evaluation windows, LoRA r=16 alpha=32 dropout=0.05 on all seven projections, AdamW lr 2e-4
(constant), activation checkpointing on, fp32 compute, the shared loop (`quantlab.training`).

Phases (see notes/baselines.md for why memory and speed are measured this way):
- memory: each configuration in a fresh process, `--repeats` times, under the allocator set by
  `--allocator` (default `MALLOC_MMAP_THRESHOLD_=65536`, which returns freed large buffers to
  the system, so resident memory tracks live tensors; `default` is glibc's own setting).
  Reported: peak resident memory after loading (and quantizing), and after `--memory-steps`
  training steps, as median and spread; tensor accounting of weights (parameters + buffers),
  trainable parameters and optimizer state. The float model's load peak is the fp32 row's.
- speed: all four configurations in one process, one optimizer step each in turn, so machine
  noise hits them alike; `--warmup` rounds are left out; median seconds per step and the ratio
  to fp32 LoRA. The runs continue to `--steps` (50) for the loss, then the held-out perplexity
  (16 windows, the shared harness) of each trained model against its untrained base.
- optimizers: full fine-tuning of the fp32 model with `adamw_torch` and `adamw_8bit`,
  alternating steps in one process, no activation checkpointing: optimizer-state bytes and
  seconds per step.

The acceptance checks of the training issue are printed at the end, each with its figures.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import environment, format_table, write_json

from quantlab.training.memory import MIB, peak_memory_bytes

CONFIGURATIONS = ("fp32-lora", "quantlab-nf4", "quantlab-4bit", "bnb-nf4")
# Memory only: bitsandbytes through quantlab's preparation, which also returns the checkpoint pages.
MEMORY_CONFIGURATIONS = (*CONFIGURATIONS, "bnb-nf4-quantlab-prepare")
LABELS = {
    "fp32-lora": "fp32 base + LoRA",
    "quantlab-nf4": "quantlab NF4 (blocksize 64, double quant) + LoRA",
    "quantlab-4bit": "quantlab custom_bits 4-bit (group 64, asymmetric) + LoRA",
    "bnb-nf4": "bitsandbytes NF4 (double quant) + LoRA, PEFT's prepare_model_for_kbit_training",
    "bnb-nf4-quantlab-prepare": "bitsandbytes NF4 + LoRA, quantlab's prepare_for_kbit_training",
}
ALLOCATORS = {"mmap65536": {"MALLOC_MMAP_THRESHOLD_": "65536"}, "default": {}}
BATCH, SEQ_LEN, RANK = 4, 256, 16


# -- building one configuration ---------------------------------------------------------------


def quantization_config(name: str) -> Any:
    import quantlab

    if name == "quantlab-nf4":
        return quantlab.NF4Config()
    if name == "quantlab-4bit":
        return quantlab.CustomBitsConfig(bits=4, group_size=64)
    if name.startswith("bnb-nf4"):
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    return None


def load_base(name: str) -> torch.nn.Module:
    """SmolLM2 in fp32, or quantized while it loads."""
    from transformers import AutoModelForCausalLM

    from quantlab.eval.models import smollm2_dir

    options: dict[str, Any] = {"dtype": torch.float32}
    if name != "fp32-lora":
        options["quantization_config"] = quantization_config(name)
    return AutoModelForCausalLM.from_pretrained(smollm2_dir(), **options)


def lora_model(base: torch.nn.Module, name: str) -> torch.nn.Module:
    from accelerate.utils import set_seed

    from quantlab.training import add_lora, enable_activation_checkpointing, prepare_for_kbit_training

    if name == "fp32-lora":
        base.requires_grad_(False)
        enable_activation_checkpointing(base)
    elif name == "bnb-nf4":  # the usual bitsandbytes recipe, as in notes/baselines.md
        from peft import prepare_model_for_kbit_training

        options = {"use_reentrant": False}
        prepare_model_for_kbit_training(base, use_gradient_checkpointing=True, gradient_checkpointing_kwargs=options)
    else:
        prepare_for_kbit_training(base, activation_checkpointing=True)
    set_seed(0)
    return add_lora(base, r=RANK, alpha=2 * RANK, dropout=0.05)


def trainer_for(model: torch.nn.Module, output_dir: Path, steps: int, optim: str = "adamw_torch", **overrides: Any):
    from quantlab.training import CausalLMCollator, Trainer, TrainingConfig, bundled_data

    tokenizer = _tokenizer()
    data = bundled_data(tokenizer, seq_len=SEQ_LEN)
    options = {
        "max_steps": steps,
        "batch_size": BATCH,
        "learning_rate": 2e-4,
        "lr_scheduler": "constant",
        "optim": optim,
        "progress_bar": False,
        "tensorboard": False,
        **overrides,
    }
    config = TrainingConfig(output_dir, **options)
    return Trainer(model, config, data.train, collator=CausalLMCollator.for_tokenizer(tokenizer))


def _tokenizer():
    from transformers import AutoTokenizer

    from quantlab.eval.models import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


def tensor_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the weights (parameters and buffers, shared ones once) and of the trainable parameters."""
    seen: set[int] = set()
    weights = trainable = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            continue
        seen.add(pointer)
        size = tensor.untyped_storage().nbytes()
        weights += size
        if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
            trainable += size
    return {"weights": weights, "trainable": trainable}


# -- memory: one configuration per fresh process ----------------------------------------------


def child_memory(name: str, steps: int) -> dict[str, Any]:
    """Run in a fresh process: peak resident memory after loading and after `steps` steps."""
    from quantlab.training import optimizer_state_bytes

    torch.set_num_threads(2)
    before = peak_memory_bytes()
    base = load_base(name)
    after_load = peak_memory_bytes()
    with torch.no_grad():  # train mode: in eval mode bitsandbytes would repack its weights for bf16 on CPU
        base.train()(input_ids=torch.tensor([[1, 2, 3, 4]]))  # a float model's weights come in from the map here
    after_forward = peak_memory_bytes()
    model = lora_model(base, name)
    accounting = tensor_bytes(model)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = trainer_for(model, Path(output_dir), steps)
        records = [trainer.train_step() for _ in range(steps)]
    return {
        "configuration": name,
        "peak_before_load_mib": before / MIB,
        "peak_after_load_mib": after_load / MIB,
        "peak_after_first_forward_mib": after_forward / MIB,
        "peak_training_mib": peak_memory_bytes() / MIB,
        "weights_mib": accounting["weights"] / MIB,
        "trainable_mib": accounting["trainable"] / MIB,
        "optimizer_state_mib": optimizer_state_bytes(trainer.optimizer) / MIB,
        "losses": [r["loss"] for r in records],
    }


def run_memory(repeats: int, steps: int, allocator: str) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in MEMORY_CONFIGURATIONS}
    environment = {**os.environ, **ALLOCATORS[allocator]}
    for repeat in range(repeats):
        for name in MEMORY_CONFIGURATIONS:  # interleaved, so a slow phase of the machine hits every configuration
            command = [sys.executable, __file__, "--child-memory", name, "--memory-steps", str(steps)]
            done = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{done.stderr[-4000:]}")
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            _progress(f"memory {repeat + 1}/{repeats} {name}: {results[name][-1]['peak_training_mib']:.0f} MiB")
    return results


# -- speed, loss and perplexity: all configurations in one process ------------------------------


def run_speed(steps: int, warmup: int) -> dict[str, Any]:
    from quantlab.eval import perplexity
    from quantlab.eval.data import bundled_text

    torch.set_num_threads(2)
    trainers, records = {}, {name: [] for name in CONFIGURATIONS}
    with tempfile.TemporaryDirectory() as scratch:
        for name in CONFIGURATIONS:
            trainers[name] = trainer_for(lora_model(load_base(name), name), Path(scratch) / name, steps)
        for step in range(steps):
            for name in CONFIGURATIONS:
                records[name].append(trainers[name].train_step())
            _progress(
                f"step {step + 1}/{steps}: "
                + ", ".join(f"{n} {records[n][-1]['seconds_per_step']:.1f} s" for n in CONFIGURATIONS)
            )
        tokenizer, text = _tokenizer(), bundled_text()
        results = {}
        for name in CONFIGURATIONS:
            trained = trainers[name].accelerator.unwrap_model(trainers[name].model)
            after = perplexity(trained, tokenizer, text)
            del trainers[name], trained
            before = perplexity(load_base(name), tokenizer, text)  # untrained adapters (B = 0) are the identity
            timed = [r["seconds_per_step"] for r in records[name][warmup:]]
            results[name] = {
                "seconds_per_step": statistics.median(timed),
                "seconds_per_step_all": [r["seconds_per_step"] for r in records[name]],
                "losses": [r["loss"] for r in records[name]],
                "perplexity_before": before,
                "perplexity_after": after,
            }
            _progress(f"{name}: perplexity {before:.3f} -> {after:.3f}")
    reference = results["fp32-lora"]["seconds_per_step"]
    for name in CONFIGURATIONS:
        # Per-round ratios, so a slow minute of the machine cancels within the round.
        mine, fp32 = (
            results[name]["seconds_per_step_all"][warmup:],
            results["fp32-lora"]["seconds_per_step_all"][warmup:],
        )
        results[name]["ratio_to_fp32_lora"] = statistics.median(a / b for a, b in zip(mine, fp32, strict=True))
        results[name]["median_ratio_of_medians"] = results[name]["seconds_per_step"] / reference
    return results


# -- optimizers: full fine-tuning, AdamW against 8-bit AdamW ----------------------------------


def run_optimizers(steps: int, warmup: int) -> dict[str, Any]:
    from quantlab.training import optimizer_state_bytes

    torch.set_num_threads(2)
    names = ("adamw_torch", "adamw_8bit")
    trainers, records = {}, {name: [] for name in names}
    with tempfile.TemporaryDirectory() as scratch:
        for optim in names:
            model = load_base("fp32-lora")
            model.requires_grad_(True)
            trainers[optim] = trainer_for(model, Path(scratch) / optim, steps, optim=optim, learning_rate=2e-5)
        for step in range(steps):
            for optim in names:
                records[optim].append(trainers[optim].train_step())
            _progress(f"full fine-tune step {step + 1}/{steps}")
        results = {}
        for optim in names:
            timed = [r["seconds_per_step"] for r in records[optim][warmup:]]
            results[optim] = {
                "optimizer_state_mib": optimizer_state_bytes(trainers[optim].optimizer) / MIB,
                "seconds_per_step": statistics.median(timed),
                "losses": [r["loss"] for r in records[optim]],
            }
    results["state_ratio"] = (
        results["adamw_8bit"]["optimizer_state_mib"] / results["adamw_torch"]["optimizer_state_mib"]
    )
    results["time_ratio"] = results["adamw_8bit"]["seconds_per_step"] / results["adamw_torch"]["seconds_per_step"]
    return results


# -- report --------------------------------------------------------------------------------------


def memory_table(memory: dict[str, list[dict[str, Any]]]) -> str:
    rows = []
    for name in MEMORY_CONFIGURATIONS:
        runs = memory[name]
        load = [r["peak_after_load_mib"] for r in runs]
        forward = [r["peak_after_first_forward_mib"] for r in runs]
        train = [r["peak_training_mib"] for r in runs]
        rows.append(
            [
                LABELS[name],
                _spread(load),
                _spread(forward),
                _spread(train),
                f"{runs[0]['weights_mib']:.0f}",
                f"{runs[0]['trainable_mib']:.1f}",
                f"{runs[0]['optimizer_state_mib']:.1f}",
            ]
        )
    columns = [
        "configuration",
        "peak after load MiB",
        "+ first forward MiB",
        "peak training MiB",
        "weights MiB",
        "trainable MiB",
        "Adam state MiB",
    ]
    return format_table(columns, rows)


def speed_table(speed: dict[str, Any]) -> str:
    rows = []
    for name in CONFIGURATIONS:
        result = speed[name]
        losses = result["losses"]
        rows.append(
            [
                LABELS[name],
                f"{result['seconds_per_step']:.2f}",
                f"{result['ratio_to_fp32_lora']:.2f}x",
                f"{losses[0]:.3f} -> {losses[-1]:.3f}",
                f"{result['perplexity_before']:.3f} -> {result['perplexity_after']:.3f}",
            ]
        )
    columns = ["configuration", "s/step (median)", "vs fp32 LoRA", f"loss 1 -> {len(losses)}", "held-out perplexity"]
    return format_table(columns, rows)


def optimizer_table(optimizers: dict[str, Any]) -> str:
    rows = [
        [name, f"{optimizers[name]['optimizer_state_mib']:.1f}", f"{optimizers[name]['seconds_per_step']:.2f}"]
        for name in ("adamw_torch", "adamw_8bit")
    ]
    rows.append(["8-bit / fp32", f"{optimizers['state_ratio']:.3f}x", f"{optimizers['time_ratio']:.2f}x"])
    return format_table(["full fine-tune optimizer", "state MiB", "s/step (median)"], rows)


def acceptance(results: dict[str, Any]) -> list[tuple[bool, str]]:
    checks = []
    memory, speed, optimizers = results.get("memory"), results.get("speed"), results.get("optimizers")
    if speed:
        nf4 = speed["quantlab-nf4"]
        checks.append(
            (
                nf4["perplexity_after"] < nf4["perplexity_before"],
                f"{len(nf4['losses'])} NF4 QLoRA steps lower held-out perplexity: "
                f"{nf4['perplexity_before']:.3f} -> {nf4['perplexity_after']:.3f}",
            )
        )
        bnb = speed["bnb-nf4"]["seconds_per_step"]
        checks.append(
            (
                nf4["ratio_to_fp32_lora"] <= 1.2,
                f"NF4 QLoRA {nf4['seconds_per_step']:.2f} s/step = {nf4['ratio_to_fp32_lora']:.2f}x fp32 LoRA, <= 1.2x",
            )
        )
        checks.append(
            (nf4["seconds_per_step"] <= bnb, f"NF4 QLoRA {nf4['seconds_per_step']:.2f} s/step <= bnb {bnb:.2f}")
        )
    if memory:
        fp32, nf4, bnb = (memory[n] for n in ("fp32-lora", "quantlab-nf4", "bnb-nf4"))
        saved = fp32[0]["weights_mib"] - nf4[0]["weights_mib"]
        best_fp32 = min(r["peak_training_mib"] for r in fp32)
        bound = best_fp32 - 0.8 * saved
        worst = max(r["peak_training_mib"] for r in nf4)
        checks.append(
            (
                worst <= bound,
                f"NF4 QLoRA peak {worst:.0f} MiB (worst run) <= fp32 LoRA peak {best_fp32:.0f} (best run) "
                f"- 0.8 x {saved:.0f} MiB of weights saved = {bound:.0f} MiB",
            )
        )
        best_bnb = min(r["peak_training_mib"] for r in bnb)
        checks.append((worst < best_bnb, f"NF4 QLoRA peak {worst:.0f} MiB < bitsandbytes NF4 QLoRA {best_bnb:.0f} MiB"))
        load_nf4 = max(r["peak_after_load_mib"] for r in nf4)
        load_fp32 = min(r["peak_after_load_mib"] for r in fp32)
        resident_fp32 = min(r["peak_after_first_forward_mib"] for r in fp32)
        checks.append(
            (
                load_nf4 < load_fp32,
                f"NF4 peak while loading+quantizing {load_nf4:.0f} MiB < fp32 load {load_fp32:.0f} MiB (weights still "
                f"lazily mapped; {resident_fp32:.0f} MiB once a forward reads them)",
            )
        )
    if optimizers:
        checks.append(
            (
                optimizers["state_ratio"] <= 0.27,
                f"8-bit AdamW state {optimizers['state_ratio']:.3f}x AdamW's (<= 0.27x)",
            )
        )
    return checks


def _spread(values: list[float]) -> str:
    middle = statistics.median(values)
    return f"{middle:.0f} ({min(values):.0f}-{max(values):.0f})" if len(values) > 1 else f"{middle:.0f}"


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", default="memory,speed,optimizers", help="comma-separated subset to run")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per configuration (memory)")
    parser.add_argument("--memory-steps", type=int, default=4, help="training steps per memory run")
    parser.add_argument("--allocator", choices=sorted(ALLOCATORS), default="mmap65536")
    parser.add_argument("--steps", type=int, default=50, help="alternating steps per configuration (speed)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--optimizer-steps", type=int, default=7, help="full fine-tuning steps per optimizer")
    parser.add_argument("--json", metavar="FILE", help="write every figure here")
    parser.add_argument("--child-memory", choices=MEMORY_CONFIGURATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory:
        print(json.dumps(child_memory(args.child_memory, args.memory_steps)))
        return

    phases = [phase.strip() for phase in args.phases.split(",") if phase.strip()]
    results: dict[str, Any] = {"environment": environment(), "allocator": args.allocator}
    if "memory" in phases:
        results["memory"] = run_memory(args.repeats, args.memory_steps, args.allocator)
        print(f"\nPeak resident memory, {args.repeats} fresh processes each, allocator {args.allocator}:\n")
        print(memory_table(results["memory"]))
        _save(args.json, results)
    if "speed" in phases:
        results["speed"] = run_speed(args.steps, args.warmup)
        print(f"\nAlternating steps in one process ({args.steps} each, first {args.warmup} not timed):\n")
        print(speed_table(results["speed"]))
        _save(args.json, results)
    if "optimizers" in phases:
        results["optimizers"] = run_optimizers(args.optimizer_steps, args.warmup)
        print("\nFull fine-tuning of SmolLM2 (no activation checkpointing), alternating steps:\n")
        print(optimizer_table(results["optimizers"]))
    checks = acceptance(results)
    results["acceptance"] = [{"passed": passed, "check": text} for passed, text in checks]
    print()
    for passed, text in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {text}")
    _save(args.json, results)


def _save(path: str | None, results: dict[str, Any]) -> None:
    """Write what is measured so far: a phase's figures survive an interrupted later phase."""
    if path:
        write_json(path, results)


if __name__ == "__main__":
    main()
