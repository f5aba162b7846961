"""`transformers.Trainer` with what quantlab's runs add: held-out perplexity and safe atomic checkpoints.

The loop, accumulation, DDP (gloo on CPU under `torchrun`/`accelerate launch`), mixed precision,
schedules and optimizers (8-bit ones included: `optim="adamw_8bit"`) are transformers'. Its
token-weighted loss is exact: every micro-batch loss is divided by the predicted-token count of
the whole optimizer step across processes (`num_items_in_batch`). What this subclass changes:

- `eval_windows` (`[windows, seq_len]` token ids, the harness's held-out text) make `evaluate`
  report `eval_perplexity` with the formula of `quantlab.eval.perplexity`.
- Checkpoints hold no pickle: Trainer's `torch.save`d `optimizer.pt`, `scheduler.pt`,
  `rng_state.pth` and `training_args.bin` become JSON + safetensors, listed with their checksums
  in a manifest that a resume checks before reading anything (`quantlab.training.checkpoints`).
- Each `checkpoint-N` is written into a hidden sibling and renamed into place, so an interrupted
  save never leaves a checkpoint that a resume picks up half-written; a full disk is one line
  naming the last complete checkpoint.
- `resume_from_checkpoint` takes `"latest"`, a run folder or a checkpoint; a new run refuses a
  folder that holds another run's checkpoints. The trained model goes to `output_dir/final`
  (unless `save_final=False`: a caller that saves it its own way, sparse say), and the run's
  `trainer_state.json` (transformers' file: its `log_history` is the log, `read_log`) to `output_dir`.
- With the progress bar off each log record is one line on stderr (`quantlab.training.log_lines`),
  not a dict on stdout.
- Callbacks with `state_dict`/`load_state_dict` (pruning masks) are checkpointed; their
  `settings()` join the run's fingerprint, so a resume with another schedule is refused.
"""

import errno
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from quantlab.errors import QuantlabError
from quantlab.training import FINAL_DIR
from quantlab.training import checkpoints as ckpt
from quantlab.training.data import CausalLMCollator, TokenSequences
from quantlab.training.evaluation import heldout_perplexity
from quantlab.training.log_lines import LogLines
from quantlab.training.state_files import write_state
from quantlab.utils.atomic import atomic_directory, atomic_file, is_staging_of_live_process

TRAINER_STATE = "trainer_state.json"
CONSTANT_SCHEDULES = ("constant", "constant_with_warmup")  # their shape does not depend on max_steps
_FINGERPRINTED_ARGS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "world_size", "seed", "data_seed", "optim",
    "optim_args", "learning_rate", "weight_decay", "max_grad_norm", "lr_scheduler_type", "lr_scheduler_kwargs",
    "warmup_steps", "bf16", "fp16",
)  # fmt: skip


class Trainer(transformers.Trainer):
    """`transformers.Trainer` for quantized models; takes the same arguments, plus `eval_windows`."""

    def __init__(
        self,
        model: torch.nn.Module,
        args: transformers.TrainingArguments,
        train_dataset: Any = None,
        *,
        eval_windows: torch.Tensor | None = None,
        data_collator: Any = None,
        callbacks: list | None = None,
        save_final: bool = True,
        **kwargs: Any,
    ) -> None:
        if not any(p.requires_grad for p in model.parameters()):
            raise QuantlabError(
                "the model has no trainable parameter: add LoRA adapters (quantlab.training.add_lora) "
                "or unfreeze the weights to fine-tune"
            )
        self.eval_windows, self.save_final = eval_windows, save_final
        if eval_windows is not None and kwargs.get("eval_dataset") is None:
            kwargs["eval_dataset"] = TokenSequences(list(eval_windows))
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator or CausalLMCollator(0),
            train_dataset=train_dataset,
            callbacks=callbacks,
            **kwargs,
        )
        # The log goes to trainer_state.json, and as lines to stderr without a progress bar; stdout belongs
        # to the caller (the CLI prints its report there).
        self.remove_callback(transformers.trainer_callback.PrinterCallback)
        self.add_callback(LogLines())

    # -- runs ---------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | Path | bool | None = None, **kwargs: Any):
        """Train (or resume: `"latest"`, a run folder or a checkpoint); the model goes to `output_dir/final`."""
        output_dir = Path(self.args.output_dir)
        if self.args.should_save:
            for leftover in output_dir.glob(f".{PREFIX_CHECKPOINT_DIR}-*"):
                if not is_staging_of_live_process(leftover):
                    shutil.rmtree(leftover, ignore_errors=True)
        if resume_from_checkpoint in (None, False) and ckpt.list_checkpoints(output_dir):
            raise ckpt.ResumeError(
                f"{output_dir} already holds checkpoints of a run; resume it (resume_from_checkpoint='latest') "
                f"or choose another output_dir"
            )
        resume = (
            None if resume_from_checkpoint in (None, False) else ckpt.resolve_resume(resume_from_checkpoint, output_dir)
        )
        try:
            result = super().train(resume_from_checkpoint=str(resume) if resume else None, **kwargs)
        except (OSError, SafetensorError) as error:
            _raise_full_disk(error, output_dir)
            raise
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            with atomic_file(output_dir / TRAINER_STATE) as staging:
                self.state.save_to_json(str(staging))
        if self.args.should_save and self.save_final:
            with atomic_directory(output_dir / FINAL_DIR, overwrite=True) as staging:
                self._save(str(staging))
        self.accelerator.wait_for_everyone()
        return result

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"):
        """Held-out perplexity on `eval_windows` when given (transformers' evaluation otherwise)."""
        if self.eval_windows is None or eval_dataset is not None:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        model = self.accelerator.unwrap_model(self.model)
        metrics = {f"{metric_key_prefix}_perplexity": heldout_perplexity(model, self.eval_windows, self.accelerator)}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # -- saving -------------------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model as `save_pretrained` writes it, and the arguments as JSON (transformers pickles them)."""
        if not self.args.should_save:
            return
        output_dir = Path(output_dir or self.args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(output_dir, state_dict=state_dict)
        else:
            ckpt.save_trainable(model, output_dir / ckpt.TRAINABLE)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        (output_dir / "training_args.json").write_text(self.args.to_json_string())

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Every process's state into a hidden sibling of `checkpoint-N`, renamed into place when complete."""
        from accelerate.utils import broadcast_object_list

        self.store_flos()
        run_dir = Path(self._get_output_dir(trial=trial))
        target = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        rng_name = f"random_states_{self.args.process_index}"
        if self.args.should_save:
            with atomic_directory(target, overwrite=True) as staging:
                broadcast_object_list([str(staging)])
                self._write_shared_state(staging)
                write_state(ckpt.capture_rng(), staging, rng_name)
                self.accelerator.wait_for_everyone()  # every process has written its RNG state
                ckpt.write_manifest(staging, self._fingerprint())
            rotate_checkpoints(str(run_dir), self.args.save_total_limit, self.state.best_model_checkpoint)
        else:
            staging = Path(broadcast_object_list([None])[0])
            write_state(ckpt.capture_rng(), staging, rng_name)
            self.accelerator.wait_for_everyone()
        self.accelerator.wait_for_everyone()

    def _write_shared_state(self, staging: Path) -> None:
        ckpt.save_trainable(self.accelerator.unwrap_model(self.model), staging / ckpt.TRAINABLE)
        write_state(self.optimizer.state_dict(), staging, "optimizer")
        write_state(self.lr_scheduler.state_dict(), staging, "scheduler")
        if self.accelerator.scaler is not None:
            write_state(self.accelerator.scaler.state_dict(), staging, "scaler")
        states = [{"callback": type(c).__name__, "state": c.state_dict()} for c in self._stateful_callbacks()]
        write_state(states, staging, "callbacks")
        exportable = [c for c in [*self.callback_handler.callbacks, self.control] if hasattr(c, "state")]
        for callback in exportable:
            if isinstance(callback, transformers.trainer_callback.ExportableState):
                self.state.stateful_callbacks[type(callback).__name__] = callback.state()
        self.state.save_to_json(str(staging / TRAINER_STATE))

    def _stateful_callbacks(self) -> list[Any]:
        return [
            c for c in self.callback_handler.callbacks if hasattr(c, "state_dict") and hasattr(c, "load_state_dict")
        ]

    def _fingerprint(self) -> dict[str, Any]:
        """What a resumed run must share with the saved one to continue it exactly."""
        values = ckpt.model_fingerprint(self.accelerator.unwrap_model(self.model))
        data = getattr(self.train_dataset, "fingerprint", None)
        values["data"] = data() if callable(data) else len(self.train_dataset)
        values.update({name: getattr(self.args, name) for name in _FINGERPRINTED_ARGS})
        if str(self.args.lr_scheduler_type.value) not in CONSTANT_SCHEDULES:
            values["max_steps"] = self.args.max_steps  # the schedule's shape depends on the run's length
        configured = [c for c in self.callback_handler.callbacks if getattr(c, "settings", lambda: None)() is not None]
        for index, callback in enumerate(configured):
            values[f"callback_{index}"] = {"callback": type(callback).__name__, **callback.settings()}
        return ckpt.as_json_values(values)

    # -- resuming: every reader of transformers' pickles replaced --------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        checkpoint = Path(resume_from_checkpoint)
        saved = ckpt.verify_checkpoint(checkpoint)
        ckpt.check_fingerprint(saved, self._fingerprint(), checkpoint)
        _check_trainer_state(checkpoint / TRAINER_STATE)
        ckpt.load_trainable(self.accelerator.unwrap_model(model or self.model), checkpoint / ckpt.TRAINABLE)
        self._load_stateful_callbacks(checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = Path(checkpoint)
        ckpt.load_into(self.optimizer, ckpt.read_checked_state(folder, "optimizer"), folder / "optimizer.json")
        ckpt.check_optimizer_state(self.optimizer, folder)
        ckpt.load_into(self.lr_scheduler, ckpt.read_checked_state(folder, "scheduler"), folder / "scheduler.json")

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self.accelerator.scaler is not None:
            folder = Path(checkpoint)
            ckpt.load_into(self.accelerator.scaler, ckpt.read_checked_state(folder, "scaler"), folder / "scaler.json")

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            name = f"random_states_{self.args.process_index}"
            ckpt.restore_rng(ckpt.read_checked_state(Path(checkpoint), name), Path(checkpoint) / f"{name}.json")

    def _load_stateful_callbacks(self, checkpoint: Path) -> None:
        entries = ckpt.read_checked_state(checkpoint, "callbacks")
        callbacks = self._stateful_callbacks()
        names = [type(c).__name__ for c in callbacks]
        if not (isinstance(entries, list) and all(isinstance(e, dict) and "state" in e for e in entries)):
            raise ckpt.ResumeError(f"{checkpoint / 'callbacks.json'} does not hold callback states; resume from "
                                   f"another checkpoint or start a new run")  # fmt: skip
        found = [entry.get("callback") for entry in entries]
        if found != names:
            raise ckpt.ResumeError(
                f"{checkpoint} holds the states of callbacks {found}, this run has {names}; "
                f"resume with the same callbacks (pruning schedule, mask keeping) or start a new run"
            )
        for callback, entry in zip(callbacks, entries, strict=True):
            ckpt.load_into(callback, entry["state"] or {}, checkpoint / "callbacks.json")


def read_log(output_dir: str | Path) -> list[dict[str, Any]]:
    """The log of a finished run: transformers' `log_history` (a record per logging step or evaluation)."""
    path = Path(output_dir) / TRAINER_STATE
    return transformers.TrainerState.load_from_json(str(path)).log_history if path.is_file() else []


def _raise_full_disk(error: Exception, run_dir: Path) -> None:
    """A full disk (safetensors reports it as text) is one line naming the checkpoint to resume from."""
    found = re.search(r"os error (\d+)", str(error)) if isinstance(error, SafetensorError) else None
    code = int(found.group(1)) if found else getattr(error, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        latest = ckpt.latest_checkpoint(run_dir)
        where = (
            f"its last complete checkpoint, {latest}, is intact: free some space and resume the run"
            if latest is not None
            else "no checkpoint was completed: free some space or write elsewhere"
        )
        raise QuantlabError(f"no space left on the device while training into {run_dir}; {where}") from error


def _check_trainer_state(path: Path) -> None:
    """transformers reads this file itself; refuse it first if it is not a valid state."""
    try:
        state = transformers.TrainerState.load_from_json(str(path))
    except (OSError, ValueError, TypeError) as error:
        raise ckpt.ResumeError(f"cannot read {path}: {error}; resume from another checkpoint") from error
    for name in ("global_step", "max_steps"):
        value = getattr(state, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ckpt.ResumeError(f"{path}: {name}={value!r} is not a valid value; resume from another checkpoint")
