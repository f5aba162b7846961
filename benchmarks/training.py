"""Training on SmolLM2-135M: the standard QLoRA recipe on `transformers.Trainer` against fp32 LoRA, and more.

    python benchmarks/training.py --phases recipe --rounds 3 --recipe-steps 3   # the recipe, ~15 min on 2 cores
    python benchmarks/training.py --json training.json          # every phase, more than an hour on 2 cores
    python benchmarks/training.py --phases memory --repeats 2   # one phase

- recipe: what a user runs (`examples/qlora_finetune.py`): `transformers.Trainer`, PEFT's
  `prepare_model_for_kbit_training` (activation checkpointing on) and `LoraConfig(target_modules=
  "all-linear")` on a quantlab NF4 base, against the same Trainer on an fp32 base with LoRA and
  activation checkpointing (non-reentrant). Each configuration runs in a fresh process, rounds
  alternate the configurations so a slow minute of the shared machine hits them alike; each run
  reports its peak resident memory and the median seconds per step after the first step, and the
  table gives median (min-max) over the rounds, the per-round ratio to fp32 LoRA, and the load
  average seen during the runs.

Every configuration: batch 4 x 256 tokens of the bundled WikiText-2 text after its 16 x 512
evaluation windows, LoRA r=16 alpha=32 dropout=0.05 on all seven projections, AdamW lr 2e-4
(constant), activation checkpointing on, fp32 compute, `quantlab.training.Trainer` (transformers'
Trainer) built by `training_run`, each step timed from `on_step_begin` to `on_step_end`.

Phases (benchmarks/RESULTS.md, "How to measure", says why memory and speed are measured this way):
- memory: each configuration in a fresh process, `--repeats` times, under the allocator set by
  `--allocator` (default `MALLOC_MMAP_THRESHOLD_=65536`, which returns freed large buffers to
  the system, so resident memory tracks live tensors; `default` is glibc's own setting).
  Reported: peak resident memory after loading (and quantizing), and after `--memory-steps`
  training steps, as median and spread; tensor accounting of weights (parameters + buffers),
  trainable parameters and optimizer state. The float model's load peak is the fp32 row's.
- speed: all four configurations in one process, one optimizer step each in turn, so machine
  noise hits them alike (each `Trainer.train()` runs in its own thread and a callback hands the
  turn on after every step: one trains at a time); `--warmup` rounds are left out; median
  (min-max) seconds per step and the per-round ratio to fp32 LoRA. The runs continue to
  `--steps` (50) for the loss, then the held-out perplexity (16 windows, the shared harness)
  of each trained model against its untrained base.
- optimizers: full fine-tuning of the fp32 model with `adamw_torch` and `adamw_8bit`,
  alternating steps in one process (taking turns as in speed), no activation checkpointing:
  optimizer-state bytes and seconds per step.

The acceptance checks are printed at the end, each with its figures.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import environment, format_table, write_json
from transformers import TrainerCallback

MIB = 1024 * 1024

CONFIGURATIONS = ("fp32-lora", "quantlab-nf4", "quantlab-4bit", "bnb-nf4")
MEMORY_CONFIGURATIONS = CONFIGURATIONS
LABELS = {
    "fp32-lora": "fp32 base + LoRA",
    "quantlab-nf4": "quantlab NF4 (blocksize 64, double quant) + LoRA",
    "quantlab-4bit": "quantlab custom_bits 4-bit (group 64, asymmetric) + LoRA",
    "bnb-nf4": "bitsandbytes NF4 (double quant) + LoRA, PEFT's prepare_model_for_kbit_training",
}
ALLOCATORS = {"mmap65536": {"MALLOC_MMAP_THRESHOLD_": "65536"}, "default": {}}
BATCH, SEQ_LEN, RANK = 4, 256, 16
OLD_LOOP_PEAK_MIB = 1392  # the peak of quantlab's own training loop, the bound the recipe must stay under


def resident_memory_bytes() -> int:
    """Resident memory of this process now."""
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) * 1024


def peak_memory_bytes() -> int:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- recipe: transformers.Trainer + PEFT, one fresh process per configuration and round -----------

RECIPE_CONFIGURATIONS = ("trainer-fp32-lora", "trainer-nf4-qlora")
RECIPE_LABELS = {
    "trainer-fp32-lora": "transformers.Trainer, fp32 base + LoRA (checkpointing)",
    "trainer-nf4-qlora": "transformers.Trainer, quantlab NF4 + PEFT recipe (all-linear)",
}


def recipe_model(name: str) -> torch.nn.Module:
    """The standard recipe: NF4 base through PEFT's k-bit preparation, or a frozen fp32 base; LoRA all-linear."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    checkpointing = {"use_reentrant": False}
    if name == "trainer-nf4-qlora":
        base = prepare_model_for_kbit_training(load_base("quantlab-nf4"), gradient_checkpointing_kwargs=checkpointing)
    else:
        base = load_base("fp32-lora")
        base.requires_grad_(False)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        base.enable_input_require_grads()
    torch.manual_seed(0)
    lora = LoraConfig(
        r=RANK, lora_alpha=2 * RANK, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    return get_peft_model(base, lora)


def child_recipe(name: str, steps: int) -> dict[str, Any]:
    """Run in a fresh process: `steps` optimizer steps of one configuration, timed step by step."""
    torch.set_num_threads(2)
    started_load = os.getloadavg()[0]
    import peft  # noqa: F401  (imported here so that the import figure below includes it)
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    after_imports = resident_memory_bytes()
    heavy_imports = [module for module in ("datasets", "pyarrow", "pandas") if module in sys.modules]
    tokenizer = _tokenizer()
    model = recipe_model(name)
    after_load = peak_memory_bytes()
    from quantlab.assets.text import bundled_text

    ids = torch.tensor(tokenizer(bundled_text(), verbose=False)["input_ids"])[16 * 512 :]
    train = [{"input_ids": chunk} for chunk in ids.split(SEQ_LEN) if len(chunk) >= 2]
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        arguments = TrainingArguments(
            output_dir=output_dir, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=2e-4,
            lr_scheduler_type="constant", optim="adamw_torch", logging_steps=1, save_strategy="no",
            report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
        )  # fmt: skip
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = Trainer(model=model, args=arguments, train_dataset=train, data_collator=collator)
        trainer.add_callback(timer)
        trainer.train()
    seconds, losses = timer.seconds, logged_losses(trainer)
    return {
        "configuration": name,
        "resident_after_imports_mib": after_imports / MIB,
        "imports_loaded": heavy_imports,
        "peak_after_load_mib": after_load / MIB,
        "peak_training_mib": peak_memory_bytes() / MIB,
        "seconds_per_step": statistics.median(seconds[1:] or seconds),  # the first step warms up
        "seconds_all": seconds,
        "losses": losses,
        "load_average": [started_load, os.getloadavg()[0]],
    }


def run_recipe(rounds: int, steps: int, allocator: str) -> dict[str, Any]:
    names = list(RECIPE_CONFIGURATIONS)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    environment = {**os.environ, **ALLOCATORS[allocator]}
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]  # alternate who goes first
        for name in order:
            command = [sys.executable, __file__, "--child-recipe", name, "--recipe-steps", str(steps)]
            done = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{done.stderr[-4000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            last = runs[name][-1]
            _progress(
                f"round {round_index + 1}/{rounds} {name}: {last['seconds_per_step']:.2f} s/step, "
                f"peak {last['peak_training_mib']:.0f} MiB, load average {last['load_average'][1]:.2f}"
            )
    return runs


def recipe_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    fp32 = runs["trainer-fp32-lora"]
    rows = []
    for name, results in runs.items():
        seconds = [r["seconds_per_step"] for r in results]
        ratios = [r["seconds_per_step"] / f["seconds_per_step"] for r, f in zip(results, fp32, strict=True)]
        memory_ratios = [r["peak_training_mib"] / f["peak_training_mib"] for r, f in zip(results, fp32, strict=True)]
        loads = [value for r in results for value in r["load_average"]]
        rows.append(
            [
                RECIPE_LABELS[name],
                _spread([r["resident_after_imports_mib"] for r in results]),
                _spread([r["peak_after_load_mib"] for r in results]),
                _spread([r["peak_training_mib"] for r in results]),
                _spread(memory_ratios, digits=2, suffix="x"),
                _spread(seconds, digits=2),
                _spread(ratios, digits=2, suffix="x"),
                f"{min(loads):.1f}-{max(loads):.1f}",
            ]
        )
    columns = [
        "configuration",
        "after imports MiB",
        "peak after load MiB",
        "peak training MiB",
        "memory vs fp32",
        "s/step",
        "time vs fp32 (per round)",
        "load average",
    ]
    loaded = sorted({module for results in runs.values() for r in results for module in r["imports_loaded"]})
    note = (
        f"\n'after imports': torch, transformers' Trainer and PEFT imported, no model yet; transformers.trainer "
        f"also imported {', '.join(loaded)} (installed here: TRL needs `datasets`)."
        if loaded
        else ""
    )
    return format_table(columns, rows) + note


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

    from quantlab.assets.models import smollm2_dir

    options: dict[str, Any] = {"dtype": torch.float32}
    if name != "fp32-lora":
        options["quantization_config"] = quantization_config(name)
    return AutoModelForCausalLM.from_pretrained(smollm2_dir(), **options)


def lora_model(base: torch.nn.Module, name: str) -> torch.nn.Module:
    from accelerate.utils import set_seed
    from peft import prepare_model_for_kbit_training

    from quantlab.training import add_lora

    if name == "fp32-lora":
        base.requires_grad_(False)
        base.activation_checkpointing_enable({"use_reentrant": False})
    else:  # the usual k-bit recipe, as bitsandbytes users run it (quantlab's layers are k-bit to PEFT)
        options = {"use_reentrant": False}
        prepare_model_for_kbit_training(base, use_gradient_checkpointing=True, gradient_checkpointing_kwargs=options)
    set_seed(0)
    return add_lora(base, r=RANK, alpha=2 * RANK, dropout=0.05)


def training_run(
    model: torch.nn.Module,
    output_dir: Path,
    steps: int,
    optim: str = "adamw_torch",
    learning_rate: float = 2e-4,
    callbacks: list[TrainerCallback] | None = None,
):
    """`quantlab.training.Trainer` for `steps` steps of batch 4 x 256 bundled tokens, constant lr, no saving."""
    from quantlab.training import CausalLMCollator, Trainer, bundled_data, training_arguments

    tokenizer = _tokenizer()
    data = bundled_data(tokenizer, seq_len=SEQ_LEN)
    arguments = training_arguments(
        {
            "output_dir": str(output_dir),
            "max_steps": steps,
            "per_device_train_batch_size": BATCH,
            "learning_rate": learning_rate,
            "lr_scheduler_type": "constant",
            "optim": optim,
            "save_steps": 0,  # no checkpoints
            "seed": 0,
            "disable_tqdm": True,
        }
    )
    collator = CausalLMCollator.for_tokenizer(tokenizer)
    return Trainer(model, arguments, data.train, data_collator=collator, callbacks=callbacks, save_final=False)


class StepTimer(TrainerCallback):
    """Seconds of each optimizer step, from `on_step_begin` to `on_step_end` (the batch is already fetched)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._started = 0.0

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.seconds.append(time.perf_counter() - self._started)


class Turns:
    """Whose turn it is among runs that step in a fixed order; a finished run leaves the rotation."""

    def __init__(self, names: list[str], on_round: Callable[[int], None] | None = None) -> None:
        self.order, self.current, self.rounds = list(names), 0, 0
        self.on_round = on_round
        self._condition = threading.Condition()

    def wait(self, name: str) -> None:
        with self._condition:
            self._condition.wait_for(lambda: self.order[self.current] == name)

    def pass_on(self, name: str) -> None:
        with self._condition:
            self.current = (self.order.index(name) + 1) % len(self.order)
            if self.current == 0:
                self.rounds += 1
                if self.on_round:
                    self.on_round(self.rounds)
            self._condition.notify_all()

    def leave(self, name: str) -> None:
        with self._condition:
            index = self.order.index(name)
            self.order.remove(name)
            self.current = index % len(self.order) if self.order else 0
            self._condition.notify_all()


class TakeTurns(StepTimer):
    """Times each step, then hands the turn to the next run and waits for it to come back."""

    def __init__(self, turns: Turns, name: str) -> None:
        super().__init__()
        self.turns, self.name = turns, name

    def on_step_end(self, args, state, control, **kwargs) -> None:
        super().on_step_end(args, state, control, **kwargs)
        if state.global_step < state.max_steps:  # after the last step, train() finishes and leaves
            self.turns.pass_on(self.name)
            self.turns.wait(self.name)


def alternate(
    runs: dict[str, Callable[[list[TrainerCallback]], Any]],
    on_round: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Build and train each run in its own thread, one optimizer step each in turn; returns the trainers.

    `runs[name](callbacks)` builds a Trainer with those callbacks. Only the run whose turn it is
    does any work (building included), so the runs are timed as if stepped one after another in
    one loop: a slow minute of the machine hits them alike. Step seconds: `trainer.step_seconds`;
    `on_round(round, {name: seconds of its last step})` after each round.
    """
    timers: dict[str, TakeTurns] = {}

    def round_done(round_number: int) -> None:
        if on_round:
            on_round(round_number, {name: timer.seconds[-1] for name, timer in timers.items() if timer.seconds})

    turns = Turns(list(runs), round_done)
    timers.update({name: TakeTurns(turns, name) for name in runs})
    trainers: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        turns.wait(name)
        try:
            timer = timers[name]
            trainers[name] = runs[name]([timer])
            trainers[name].step_seconds = timer.seconds
            trainers[name].train()
        except BaseException as error:  # reported in the main thread, after the others finish
            errors.append(error)
        finally:
            turns.leave(name)

    threads = [threading.Thread(target=run, args=(name,), name=f"train-{name}") for name in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return trainers


def logged_losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (moments, quantization maps, absmax), each counted once."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel():
                pointer = value.untyped_storage().data_ptr()
                if pointer not in seen:
                    seen.add(pointer)
                    total += value.untyped_storage().nbytes()
    return total


def _tokenizer():
    from transformers import AutoTokenizer

    from quantlab.assets.models import smollm2_dir

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
        trainer = training_run(model, Path(output_dir), steps)
        trainer.train()
    return {
        "configuration": name,
        "peak_before_load_mib": before / MIB,
        "peak_after_load_mib": after_load / MIB,
        "peak_after_first_forward_mib": after_forward / MIB,
        "peak_training_mib": peak_memory_bytes() / MIB,
        "weights_mib": accounting["weights"] / MIB,
        "trainable_mib": accounting["trainable"] / MIB,
        "optimizer_state_mib": optimizer_state_bytes(trainer.optimizer) / MIB,
        "losses": logged_losses(trainer),
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
    from quantlab.assets.text import bundled_text
    from quantlab.eval import perplexity

    torch.set_num_threads(2)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:

        def build(name: str) -> Callable[[list[TrainerCallback]], Any]:
            return lambda callbacks: training_run(
                lora_model(load_base(name), name), Path(scratch) / name, steps, callbacks=callbacks
            )

        def progress(round_number: int, last: dict[str, float]) -> None:
            _progress(f"step {round_number}/{steps}: " + ", ".join(f"{n} {t:.1f} s" for n, t in last.items()))

        trainers = alternate({name: build(name) for name in CONFIGURATIONS}, on_round=progress)
        load_after = os.getloadavg()[0]
        tokenizer, text = _tokenizer(), bundled_text()
        results = {}
        for name in CONFIGURATIONS:
            trainer = trainers.pop(name)
            trained = trainer.accelerator.unwrap_model(trainer.model)
            after = perplexity(trained, tokenizer, text)
            seconds, losses = trainer.step_seconds, logged_losses(trainer)
            del trainer, trained
            before = perplexity(load_base(name), tokenizer, text)  # untrained adapters (B = 0) are the identity
            results[name] = {
                "seconds_per_step": statistics.median(seconds[warmup:]),
                "seconds_per_step_all": seconds,
                "losses": losses,
                "perplexity_before": before,
                "perplexity_after": after,
                "load_average": [load_before, load_after],
            }
            _progress(f"{name}: perplexity {before:.3f} -> {after:.3f}")
    reference = results["fp32-lora"]["seconds_per_step"]
    for name in CONFIGURATIONS:
        # Per-round ratios, so a slow minute of the machine cancels within the round.
        mine, fp32 = (
            results[name]["seconds_per_step_all"][warmup:],
            results["fp32-lora"]["seconds_per_step_all"][warmup:],
        )
        results[name]["ratios_to_fp32_lora"] = [a / b for a, b in zip(mine, fp32, strict=True)]
        results[name]["ratio_to_fp32_lora"] = statistics.median(results[name]["ratios_to_fp32_lora"])
        results[name]["median_ratio_of_medians"] = results[name]["seconds_per_step"] / reference
    return results


# -- optimizers: full fine-tuning, AdamW against 8-bit AdamW ----------------------------------


def run_optimizers(steps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(2)
    names = ("adamw_torch", "adamw_8bit")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:

        def build(optim: str) -> Callable[[list[TrainerCallback]], Any]:
            def run(callbacks: list[TrainerCallback]) -> Any:
                model = load_base("fp32-lora")
                model.requires_grad_(True)
                return training_run(
                    model, Path(scratch) / optim, steps, optim=optim, learning_rate=2e-5, callbacks=callbacks
                )

            return run

        trainers = alternate(
            {optim: build(optim) for optim in names},
            on_round=lambda round_number, _: _progress(f"full fine-tune step {round_number}/{steps}"),
        )
        load_after = os.getloadavg()[0]
        results = {}
        for optim in names:
            seconds = trainers[optim].step_seconds
            results[optim] = {
                "optimizer_state_mib": optimizer_state_bytes(trainers[optim].optimizer) / MIB,
                "seconds_per_step": statistics.median(seconds[warmup:]),
                "seconds_per_step_all": seconds,
                "losses": logged_losses(trainers[optim]),
                "load_average": [load_before, load_after],
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
        "after imports MiB",
        "peak after load MiB",
        "+ first forward MiB",
        "peak training MiB",
        "weights MiB",
        "trainable MiB",
        "Adam state MiB",
    ]
    return format_table(columns, rows)


def speed_table(speed: dict[str, Any], warmup: int) -> str:
    rows = []
    for name in CONFIGURATIONS:
        result = speed[name]
        losses = result["losses"]
        rows.append(
            [
                LABELS[name],
                _spread(result["seconds_per_step_all"][warmup:], digits=2),
                _spread(result["ratios_to_fp32_lora"], digits=2, suffix="x"),
                f"{losses[0]:.3f} -> {losses[-1]:.3f}",
                f"{result['perplexity_before']:.3f} -> {result['perplexity_after']:.3f}",
            ]
        )
    columns = ["configuration", "s/step", "vs fp32 LoRA (per round)", f"loss 1 -> {len(losses)}", "held-out perplexity"]
    return format_table(columns, rows)


def optimizer_table(optimizers: dict[str, Any], warmup: int) -> str:
    rows = [
        [
            name,
            f"{optimizers[name]['optimizer_state_mib']:.1f}",
            _spread(optimizers[name]["seconds_per_step_all"][warmup:], digits=2),
        ]
        for name in ("adamw_torch", "adamw_8bit")
    ]
    rows.append(["8-bit / fp32", f"{optimizers['state_ratio']:.3f}x", f"{optimizers['time_ratio']:.2f}x"])
    return format_table(["full fine-tune optimizer", "state MiB", "s/step"], rows)


def _load_range(load_average: list[float]) -> str:
    return f"load average {load_average[0]:.2f} before, {load_average[1]:.2f} after"


def acceptance(results: dict[str, Any]) -> list[tuple[bool, str]]:
    checks = []
    memory, speed, optimizers = results.get("memory"), results.get("speed"), results.get("optimizers")
    recipe = results.get("recipe")
    if recipe:
        fp32, nf4 = recipe["trainer-fp32-lora"], recipe["trainer-nf4-qlora"]
        worst_nf4, best_fp32 = max(r["peak_training_mib"] for r in nf4), min(r["peak_training_mib"] for r in fp32)
        checks.append(
            (worst_nf4 <= best_fp32, f"recipe NF4 QLoRA peak {worst_nf4:.0f} MiB (worst run) <= fp32 LoRA "
             f"{best_fp32:.0f} MiB (best run)")
        )  # fmt: skip
        ratios = [n["seconds_per_step"] / f["seconds_per_step"] for n, f in zip(nf4, fp32, strict=True)]
        median_ratio = statistics.median(ratios)
        checks.append((median_ratio <= 1.2, f"recipe NF4 QLoRA {median_ratio:.2f}x fp32 LoRA per step, <= 1.2x"))
        imports = statistics.median(r["resident_after_imports_mib"] for r in nf4)
        checks.append(
            (worst_nf4 <= OLD_LOOP_PEAK_MIB, f"recipe NF4 QLoRA peak {worst_nf4:.0f} MiB (worst run) <= the bound "
             f"{OLD_LOOP_PEAK_MIB} MiB, of which {imports:.0f} MiB resident after imports")
        )  # fmt: skip
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


def _spread(values: list[float], digits: int = 0, suffix: str = "") -> str:
    """Median (min-max) of the runs."""
    middle = statistics.median(values)
    if len(values) == 1:
        return f"{middle:.{digits}f}{suffix}"
    return f"{middle:.{digits}f}{suffix} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", default="recipe,memory,speed,optimizers", help="comma-separated subset to run")
    parser.add_argument("--rounds", type=int, default=3, help="fresh-process rounds per configuration (recipe)")
    parser.add_argument("--recipe-steps", type=int, default=6, help="optimizer steps per recipe run")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per configuration (memory)")
    parser.add_argument("--memory-steps", type=int, default=4, help="training steps per memory run")
    parser.add_argument("--allocator", choices=sorted(ALLOCATORS), default="mmap65536")
    parser.add_argument("--steps", type=int, default=50, help="alternating steps per configuration (speed)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--optimizer-steps", type=int, default=7, help="full fine-tuning steps per optimizer")
    parser.add_argument("--json", metavar="FILE", help="write every figure here")
    parser.add_argument("--child-memory", choices=MEMORY_CONFIGURATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--child-recipe", choices=RECIPE_CONFIGURATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_recipe:
        print(json.dumps(child_recipe(args.child_recipe, args.recipe_steps)))
        return
    if args.child_memory:
        print(json.dumps(child_memory(args.child_memory, args.memory_steps)))
        return

    phases = [phase.strip() for phase in args.phases.split(",") if phase.strip()]
    results: dict[str, Any] = {"environment": environment(), "allocator": args.allocator}
    if "recipe" in phases:
        load_before = os.getloadavg()
        results["recipe"] = run_recipe(args.rounds, args.recipe_steps, args.allocator)
        load_after = os.getloadavg()
        print(
            f"\nThe standard recipe, {args.rounds} alternated rounds of {args.recipe_steps} steps, one fresh process "
            f"each, allocator {args.allocator}, median (min-max); load average (1/5/15 min) "
            f"{'/'.join(f'{v:.2f}' for v in load_before)} before, {'/'.join(f'{v:.2f}' for v in load_after)} after:\n"
        )
        print(recipe_table(results["recipe"]))
        _save(args.json, results)
    if "memory" in phases:
        load_before = os.getloadavg()[0]
        results["memory"] = run_memory(args.repeats, args.memory_steps, args.allocator)
        load = _load_range([load_before, os.getloadavg()[0]])
        print(
            f"\nPeak resident memory, {args.repeats} fresh processes each, allocator {args.allocator}, "
            f"median (min-max); {load}:\n"
        )
        print(memory_table(results["memory"]))
        _save(args.json, results)
    if "speed" in phases:
        results["speed"] = run_speed(args.steps, args.warmup)
        load = _load_range(results["speed"]["fp32-lora"]["load_average"])
        print(
            f"\nAlternating steps in one process ({args.steps} each, first {args.warmup} not timed), "
            f"median (min-max); {load}:\n"
        )
        print(speed_table(results["speed"], args.warmup))
        _save(args.json, results)
    if "optimizers" in phases:
        results["optimizers"] = run_optimizers(args.optimizer_steps, args.warmup)
        load = _load_range(results["optimizers"]["adamw_torch"]["load_average"])
        print(
            f"\nFull fine-tuning of SmolLM2 (no activation checkpointing), alternating steps "
            f"({args.optimizer_steps} each, first {args.warmup} not timed), median (min-max); {load}:\n"
        )
        print(optimizer_table(results["optimizers"], args.warmup))
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
