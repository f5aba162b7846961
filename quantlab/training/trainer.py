"""The shared training loop: QLoRA, full fine-tuning, and (through callbacks and losses) pruning and distillation.

Built on accelerate: the `Accelerator` owns device placement, DDP (gloo on CPU), mixed
precision and fp16 loss scaling, gradient accumulation (`accumulate`, no gradient sync on
the inner micro-batches) and gradient clipping. Checkpoints are the loop's own (not
accelerate's `save_state`, whose state files are pickles): only the trainable parameters,
and every state in JSON + safetensors with its checksum (`checkpoint_files`). The loop adds what a
fine-tuning run needs around it: exact token-weighted losses across micro-batches and
processes, schedules in optimizer steps, a data order that resumes bit-identically, held-out
evaluation, logging, atomic rotating checkpoints, and hooks for extensions.

Extensions: `callbacks` (see `quantlab.training.callbacks`) run at fixed points of each
step; `loss` replaces the default next-token loss (see `quantlab.training.loss`);
`extra_modules` brings further models into the run: frozen ones (a teacher) are moved to the
device and kept in eval mode, trainable ones (a projection head) are optimized, wrapped for
DDP and checkpointed with the model. The loss reaches them as `trainer.extra_modules[name]`.
"""

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from quantlab.errors import QuantlabError
from quantlab.training import checkpoint as ckpt
from quantlab.training import checkpoint_files as ckpt_files
from quantlab.training.callbacks import Callback, CallbackList, EmptyCacheEvery, ProfilerWindow
from quantlab.training.config import TrainingConfig
from quantlab.training.data import CausalLMCollator, ShardedBatches
from quantlab.training.evaluation import heldout_perplexity
from quantlab.training.kbit import enable_activation_checkpointing
from quantlab.training.loss import CausalLMLoss, LossFunction, predicted_tokens
from quantlab.training.memory import MIB, current_memory_bytes, peak_memory_bytes
from quantlab.training.optimizers import build_optimizer, build_scheduler, check_optimizer_name, optimizer_state_bytes
from quantlab.training.reporting import RunLog
from quantlab.training.state_files import write_state
from quantlab.utils.atomic import atomic_directory

FINAL_DIR = "final"


class PrecisionError(QuantlabError):
    """The requested mixed precision cannot run on this device."""


@dataclasses.dataclass
class TrainResult:
    steps: int
    loss: float | None
    eval_perplexity: float | None
    peak_memory_mib: float
    seconds: float
    output_dir: Path
    final_dir: Path | None


class Trainer:
    """Train `model` on `train_data` (a dataset of `{"input_ids": tensor}` examples) as `config` says."""

    def __init__(
        self,
        model: nn.Module,
        config: TrainingConfig,
        train_data: Dataset,
        *,
        eval_windows: torch.Tensor | None = None,
        collator: Any = None,
        loss: LossFunction | None = None,
        callbacks: list[Callback] | tuple[Callback, ...] = (),
        extra_modules: dict[str, nn.Module] | None = None,
    ) -> None:
        check_optimizer_name(config.optim)
        self.config = config
        self.train_data = train_data
        self.eval_windows = eval_windows
        self.collator = collator or CausalLMCollator(pad_token_id=0)
        self.loss_fn = loss or CausalLMLoss()
        self.accelerator = make_accelerator(config)
        self.state = ckpt.TrainerState()
        self.callbacks = CallbackList(list(callbacks) + self._builtin_callbacks())
        if config.activation_checkpointing:
            enable_activation_checkpointing(model)
        extra_modules = dict(extra_modules or {})
        self._check_trainable(model, extra_modules)
        self.extra_modules, trainable_extras = self._place_extra_modules(extra_modules)
        modules = [model, *trainable_extras.values()]
        optimizer = build_optimizer(
            config.optim,
            [(n, p) for module in modules for n, p in module.named_parameters()],
            lr=config.learning_rate,
            weight_decay=config.weight_decay,
            **config.optim_args,
        )
        scheduler = build_scheduler(
            config.lr_scheduler, optimizer, config.num_warmup_steps, config.max_steps, **config.scheduler_args
        )
        prepared = self.accelerator.prepare(*modules, optimizer, scheduler)
        self.model, self.optimizer, self.scheduler = prepared[0], prepared[-2], prepared[-1]
        for name, module in zip(trainable_extras, prepared[1:-2], strict=True):
            self.extra_modules[name] = module
        self._trained_modules = list(prepared[:-2])
        self.batches = ShardedBatches(
            num_examples=len(train_data),
            batch_size=config.batch_size,
            world_size=self.accelerator.num_processes,
            rank=self.accelerator.process_index,
            seed=config.seed,
        )
        self.fingerprint = self._fingerprint()

    # -- setup ------------------------------------------------------------------------------

    def _builtin_callbacks(self) -> list[Callback]:
        config = self.config
        callbacks: list[Callback] = []
        if config.empty_cache_every:
            callbacks.append(EmptyCacheEvery(config.empty_cache_every))
        if config.profile_steps is not None:
            callbacks.append(ProfilerWindow(*config.profile_steps, output_dir=Path(config.output_dir) / "profile"))
        return callbacks

    @staticmethod
    def _check_trainable(model: nn.Module, extra_modules: dict[str, nn.Module]) -> None:
        if not any(p.requires_grad for p in model.parameters()):
            raise QuantlabError(
                "the model has no trainable parameter: add LoRA adapters (quantlab.training.add_lora) "
                "or unfreeze the weights to fine-tune"
            )
        if "model" in extra_modules:
            raise QuantlabError("'model' is the trained model's name; give the extra module another name")

    def _place_extra_modules(self, modules: dict[str, nn.Module]) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
        frozen, trainable = {}, {}
        for name, module in modules.items():
            if any(p.requires_grad for p in module.parameters()):
                trainable[name] = module
            else:
                frozen[name] = module.to(self.accelerator.device).eval()
        return frozen, trainable

    def _fingerprint(self) -> dict[str, Any]:
        """What a resumed run must share with the saved one to continue it exactly."""
        config = self.config
        model = self.accelerator.unwrap_model(self.model)
        fingerprint = ckpt.model_fingerprint(model)
        for index, module in enumerate(self._trained_modules[1:], start=1):
            fingerprint[f"extra_module_{index}"] = ckpt.model_fingerprint(self.accelerator.unwrap_model(module))
        data_fingerprint = getattr(self.train_data, "fingerprint", None)
        fingerprint.update(
            data=data_fingerprint() if callable(data_fingerprint) else len(self.train_data),
            batch_size=config.batch_size,
            grad_accum=config.grad_accum,
            processes=self.accelerator.num_processes,
            seed=config.seed,
            optim=config.optim,
            optim_args=config.optim_args,
            precision=config.precision,
            learning_rate=config.learning_rate,
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
            lr_scheduler=config.lr_scheduler,
            scheduler_args=config.scheduler_args,
            warmup_steps=config.num_warmup_steps,
            loss=ckpt.settings_of(self.loss_fn),
        )
        if config.lr_scheduler not in ckpt.SCHEDULES_WITHOUT_LENGTH:
            fingerprint["max_steps"] = config.max_steps  # the schedule's shape depends on its length
        configured = [c for c in self.callbacks.callbacks if c.settings() is not None]
        for index, callback in enumerate(configured):
            fingerprint[f"callback_{index}"] = {"callback": type(callback).__name__, **callback.settings()}
        return ckpt.as_json_values(fingerprint)

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> TrainResult:
        config, accelerator = self.config, self.accelerator
        output_dir = Path(config.output_dir)
        self._start_run(output_dir)
        log = RunLog(
            output_dir,
            config.max_steps,
            self.state.step,
            enabled=accelerator.is_main_process,
            progress_bar=config.progress_bar,
            tensorboard=config.tensorboard,
        )
        started = time.perf_counter()
        last_loss = perplexity = None
        try:
            self.callbacks.call("on_train_begin", self)
            if config.eval_every and self.state.step == 0:
                perplexity = self._evaluate(log)
            while self.state.step < config.max_steps:
                record = self.train_step()
                last_loss = record["loss"]
                step = self.state.step
                if step % config.log_every == 0 or step == config.max_steps:
                    self.callbacks.call("on_log", self, record)
                    log.write(record)
                log.advance(step, {"loss": record["loss"], "lr": record["lr"]})
                if config.eval_every and (step % config.eval_every == 0 or step == config.max_steps):
                    perplexity = self._evaluate(log)
                if config.save_every and (step % config.save_every == 0 or step == config.max_steps):
                    self.save_checkpoint()
            final_dir = self._save_final(output_dir)
            self.callbacks.call("on_train_end", self)
        finally:
            log.close()
        peak = self._max_over_processes(peak_memory_bytes(accelerator.device)) / MIB
        return TrainResult(
            steps=self.state.step,
            loss=last_loss,
            eval_perplexity=perplexity,
            peak_memory_mib=peak,
            seconds=time.perf_counter() - started,
            output_dir=output_dir,
            final_dir=final_dir,
        )

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `grad_accum` micro-batches; returns its log record.

        `train` calls it after setting up the run (resume, seeding, log); benchmarks that
        alternate several runs call it directly.
        """
        config, accelerator = self.config, self.accelerator
        for module in self._trained_modules:
            module.train()  # dropout on, and transformers checkpoints activations only in train mode
        self.callbacks.call("on_step_begin", self)
        started = time.perf_counter()
        micro_batches = [self._next_batch() for _ in range(config.grad_accum)]
        predicted = sum(predicted_tokens(b) for b in micro_batches)
        tokens = sum(int(b["attention_mask"].sum()) for b in micro_batches)
        counts = torch.tensor([predicted, tokens], device=accelerator.device)
        num_items, num_tokens = (int(v) for v in self._sum_over_processes(counts))
        # Each micro-batch loss is already divided by the step's token count; undo the averaging
        # that accelerate (over micro-batches) and DDP (over processes) apply to the gradients.
        compensation = config.grad_accum * accelerator.num_processes
        total = torch.zeros((), device=accelerator.device, dtype=torch.float64)
        metrics: dict[str, torch.Tensor] = {}
        for batch in micro_batches:
            with accelerator.accumulate(*self._trained_modules), accelerator.autocast():
                output = self.loss_fn(self, self.model, batch, num_items)
                accelerator.backward(output.loss * compensation)
            total += output.loss.detach().double()
            for key, value in output.metrics.items():
                metrics[key] = metrics.get(key, 0) + value.detach().double()
        if not accelerator.sync_gradients:
            raise RuntimeError("gradient accumulation fell out of step with the optimizer steps")
        self.callbacks.call("on_before_optimizer_step", self)
        grad_norm = accelerator.clip_grad_norm_(self._trained_parameters(), config.max_grad_norm or math.inf)
        self.optimizer.step()
        if not accelerator.optimizer_step_was_skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens_seen += num_tokens
        self.callbacks.call("on_optimizer_step", self)
        reduced = self._sum_over_processes(torch.stack([total, *metrics.values()]))
        seconds = time.perf_counter() - started
        record = {
            "step": self.state.step,
            "epoch": self.state.epoch,
            "loss": float(reduced[0]),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "tokens": num_tokens,
            "tokens_per_second": num_tokens / seconds,
            "seconds_per_step": seconds,
            "peak_memory_mib": self._max_over_processes(peak_memory_bytes(accelerator.device)) / MIB,
            "memory_mib": current_memory_bytes(accelerator.device) / MIB,
            "optimizer_state_mib": optimizer_state_bytes(self.optimizer) / MIB,
        }
        record.update({key: float(value) for key, value in zip(metrics, reduced[1:], strict=True)})
        return record

    def _next_batch(self) -> dict[str, torch.Tensor]:
        state = self.state
        if state.batch_in_epoch == self.batches.batches_per_epoch:
            state.epoch += 1
            state.batch_in_epoch = 0
        indices = self.batches.indices(state.epoch, state.batch_in_epoch)
        state.batch_in_epoch += 1
        batch = self.collator([self.train_data[i] for i in indices])
        return {key: value.to(self.accelerator.device) for key, value in batch.items()}

    def _trained_parameters(self) -> list[nn.Parameter]:
        return [p for module in self._trained_modules for p in module.parameters() if p.requires_grad]

    def _evaluate(self, log: RunLog) -> float | None:
        if self.eval_windows is None:
            return None
        perplexity = heldout_perplexity(self.accelerator.unwrap_model(self.model), self.eval_windows, self.accelerator)
        metrics = {"eval_perplexity": perplexity}
        self.callbacks.call("on_evaluate", self, metrics)
        log.write({"step": self.state.step, **metrics})
        return perplexity

    def _sum_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return values
        return self.accelerator.reduce(values, reduction="sum")

    def _max_over_processes(self, value: float) -> float:
        if self.accelerator.num_processes == 1:
            return float(value)
        return float(self.accelerator.gather(torch.tensor([float(value)], device=self.accelerator.device)).max())

    # -- checkpoints ------------------------------------------------------------------------

    def _start_run(self, output_dir: Path) -> None:
        """Resume if asked; otherwise refuse to mix a new run into a folder holding another's checkpoints."""
        config = self.config
        if self.accelerator.is_main_process:
            output_dir.mkdir(parents=True, exist_ok=True)
            ckpt.remove_staging_leftovers(output_dir)
        self.accelerator.wait_for_everyone()
        if config.resume_from is not None:
            self.resume(ckpt.resolve_resume(config.resume_from, output_dir))
        elif ckpt.list_checkpoints(output_dir):
            raise ckpt.ResumeError(
                f"{output_dir} already holds checkpoints of a run; pass resume_from='latest' to continue it, "
                f"or choose another output_dir"
            )
        from accelerate.utils import set_seed

        if config.resume_from is None:
            set_seed(config.seed, device_specific=True)

    def resume(self, checkpoint: Path) -> None:
        """Load adapters, optimizer, scheduler, RNG, callback states and data position from `checkpoint`.

        Every file is checked against the size and checksum recorded when it was saved before
        it is read, and none is a pickle: a damaged or foreign checkpoint is refused, never run.
        """
        saved = ckpt.TrainerState.read(checkpoint)
        ckpt.check_fingerprint(saved.fingerprint, self.fingerprint, checkpoint)
        files, unwrap = saved.files, self.accelerator.unwrap_model
        try:
            for index, module in enumerate(self._trained_modules):
                ckpt_files.verify_file(checkpoint, _trainable_file(index), files)
                ckpt.load_trainable(unwrap(module), checkpoint / _trainable_file(index))
            for name, target in self._stateful_objects().items():
                _load_into(target, ckpt_files.read(checkpoint, name, files), checkpoint / name)
            ckpt_files.check_optimizer_state(self.optimizer, checkpoint)
            callbacks = ckpt_files.read(checkpoint, ckpt_files.CALLBACKS, files)
            self._load_callback_states(callbacks, checkpoint)
            rank = self.accelerator.process_index
            rng_name = ckpt_files.rng_name(rank)
            ckpt_files.restore_rng(ckpt_files.read(checkpoint, rng_name, files), checkpoint / f"{rng_name}.json")
        except ckpt_files.DamagedCheckpointError as error:
            raise ckpt.ResumeError(str(error)) from error
        self.state = saved

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of the current step atomically (all processes call this), then rotate."""
        from accelerate.utils import broadcast_object_list

        accelerator = self.accelerator
        output_dir = Path(self.config.output_dir)
        target = ckpt.checkpoint_dir(output_dir, self.state.step)
        self.state.fingerprint = self.fingerprint
        rng_name = ckpt_files.rng_name(accelerator.process_index)
        if accelerator.is_main_process:
            with atomic_directory(target, overwrite=True) as staging:
                broadcast_object_list([str(staging)])
                self._write_shared_state(staging)
                write_state(ckpt_files.capture_rng(), staging, rng_name)
                accelerator.wait_for_everyone()  # every process has written its RNG state
                self.state.files = ckpt_files.manifest(staging, exclude=ckpt.STATE_FILE)
                (staging / ckpt.STATE_FILE).write_text(self.state.to_json())
            ckpt.rotate(output_dir, self.config.keep_last)
        else:
            staging = broadcast_object_list([None])[0]
            write_state(ckpt_files.capture_rng(), Path(staging), rng_name)
            accelerator.wait_for_everyone()
        accelerator.wait_for_everyone()
        self.callbacks.call("on_save", self, target)
        return target

    def _write_shared_state(self, staging: Path) -> None:
        """What every process shares: trained weights, optimizer, scheduler, scaler, callback states."""
        for index, module in enumerate(self._trained_modules):
            ckpt.save_trainable(self.accelerator.unwrap_model(module), staging / _trainable_file(index))
        for name, source in self._stateful_objects().items():
            write_state(source.state_dict(), staging, name)
        states = [{"callback": type(c).__name__, "state": c.state_dict()} for c in self._stateful_callbacks()]
        write_state(states, staging, ckpt_files.CALLBACKS)

    def _stateful_objects(self) -> dict[str, Any]:
        objects = {ckpt_files.OPTIMIZER: self.optimizer, ckpt_files.SCHEDULER: self.scheduler}
        if self.accelerator.scaler is not None:
            objects[ckpt_files.SCALER] = self.accelerator.scaler
        return objects

    def _stateful_callbacks(self) -> list[Callback]:
        return [c for c in self.callbacks.callbacks if type(c).state_dict is not Callback.state_dict]

    def _load_callback_states(self, saved: Any, checkpoint: Path) -> None:
        callbacks = self._stateful_callbacks()
        names = [type(c).__name__ for c in callbacks]
        found = [entry.get("callback") for entry in saved] if isinstance(saved, list) else None
        if found is None or any(not isinstance(entry, dict) or "state" not in entry for entry in saved):
            raise ckpt_files.DamagedCheckpointError(f"{checkpoint / 'callbacks.json'} does not hold callback states")
        if found != names:
            raise ckpt.ResumeError(
                f"{checkpoint} holds the states of callbacks {found}, this run has {names}; "
                f"resume with the same callbacks (pruning schedule, mask keeping) or start a new run"
            )
        for callback, entry in zip(callbacks, saved, strict=True):
            _load_into(callback, entry["state"] or {}, checkpoint / "callbacks.json")

    def _save_final(self, output_dir: Path) -> Path | None:
        """The trained model (or adapter) in its own format, for use outside the loop."""
        accelerator = self.accelerator
        accelerator.wait_for_everyone()
        model = accelerator.unwrap_model(self.model)
        final = output_dir / FINAL_DIR
        if accelerator.is_main_process and hasattr(model, "save_pretrained"):
            with atomic_directory(final, overwrite=True) as staging:
                model.save_pretrained(staging)
        accelerator.wait_for_everyone()
        return final if hasattr(model, "save_pretrained") else None


def _load_into(target: Any, state: Any, source: Path) -> None:
    """`target.load_state_dict(state)`; a state of the wrong form is a damaged checkpoint, not a traceback."""
    try:
        target.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as error:
        raise ckpt_files.DamagedCheckpointError(
            f"{source} does not fit this run's {type(target).__name__} ({type(error).__name__}: {error}); "
            f"resume from another checkpoint or start a new run"
        ) from error


def make_accelerator(config: TrainingConfig):
    """An `Accelerator` for this run; refuses precisions the device cannot run."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType, GradientAccumulationPlugin

    # accelerate keeps its settings in process-wide singletons; a run owns them for its duration,
    # so a second run in the same process (tests, benchmarks) may choose another precision.
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    plugin = GradientAccumulationPlugin(num_steps=config.grad_accum, adjust_scheduler=False, sync_with_dataloader=False)
    try:
        accelerator = Accelerator(
            cpu=not _has_accelerator_device(),  # accelerate sets up gloo DDP under torchrun only when told "cpu"
            mixed_precision=config.mixed_precision,
            gradient_accumulation_plugin=plugin,
            step_scheduler_with_optimizer=False,
            dynamo_backend="inductor" if config.compile else None,
        )
    except ValueError as error:
        raise PrecisionError(f"cannot train with precision={config.precision!r} here: {error}") from error
    if (
        config.precision == "fp16"
        and accelerator.scaler is None
        and accelerator.distributed_type != DistributedType.DEEPSPEED
    ):
        raise PrecisionError(
            f"precision='fp16' needs a GPU with fp16 autocast and loss scaling, but this run is on "
            f"{accelerator.device.type}; use precision='bf16' or 'fp32'"
        )
    return accelerator


def _has_accelerator_device() -> bool:
    accelerator_api = getattr(torch, "accelerator", None)
    if accelerator_api is not None and hasattr(accelerator_api, "is_available"):
        return bool(accelerator_api.is_available())
    return torch.cuda.is_available()


def _trainable_file(index: int) -> str:
    return "trainable.safetensors" if index == 0 else f"trainable_{index}.safetensors"
