"""Training checkpoints: layout, atomic writes, rotation, and finding where to resume.

A run folder holds `checkpoints/step-00000050/`, one per saved step. Each is written into a
hidden staging folder and renamed into place once complete (`quantlab.utils.atomic`), so a
crash or a full disk mid-write leaves the previous checkpoint as the latest usable one.
Inside: `trainable.safetensors` (only the parameters that train: LoRA adapters stay small,
the frozen base is not copied), the optimizer, scheduler, gradient scaler, callback and
per-process RNG states as JSON + safetensors (`checkpoint_files`; never pickles), and
`trainer_state.json` (step, data position, the run's fingerprint, and the size and SHA-256
of every other file). Resuming checks the fingerprint first, so a folder of another model,
adapter layout, data set, batch layout or hyperparameters is refused with the differences
named, then the checksums, so a truncated or edited file is refused instead of resuming a
run that is no longer the same.
"""

import dataclasses
import enum
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from quantlab.errors import QuantlabError

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^step-(\d+)$")
# Schedules whose shape does not depend on the run's length: such a run may be resumed with more steps.
SCHEDULES_WITHOUT_LENGTH = ("constant", "constant_with_warmup")
# Adapter options that do not change a resumed run (the weights come from the checkpoint) or are bookkeeping.
_ADAPTER_FIELDS_WITHOUT_EFFECT = (
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "peft_version",
    "init_lora_weights",
)


class ResumeError(QuantlabError):
    """A checkpoint cannot be resumed from in this run."""


@dataclasses.dataclass
class TrainerState:
    """Where the loop stands: optimizer steps done and the data position after them."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0
    fingerprint: dict[str, Any] = dataclasses.field(default_factory=dict)
    files: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> {"bytes", "sha256"} of every state file

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def read(cls, checkpoint: Path) -> "TrainerState":
        """The state saved in `checkpoint`; a damaged, edited or pre-manifest file is a `ResumeError`."""
        path = Path(checkpoint) / STATE_FILE
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ResumeError(f"cannot read {path}: {error}; resume from another checkpoint") from error
        fields = {field.name: field.type for field in dataclasses.fields(cls)}
        if isinstance(values, dict) and set(values) == set(fields) - {"files"}:
            raise ResumeError(
                f"{checkpoint} was written by an earlier quantlab that stored optimizer and RNG state as pickles, "
                f"which are never read (they can run code); start a new run"
            )
        if not isinstance(values, dict) or set(values) != set(fields):
            found = sorted(values) if isinstance(values, dict) else type(values).__name__
            raise ResumeError(
                f"{path} is not a quantlab trainer state (fields {found}); resume from another checkpoint"
            )
        for name, value in values.items():
            expected = dict if name in ("fingerprint", "files") else int
            if not isinstance(value, expected) or isinstance(value, bool) or (expected is int and value < 0):
                raise ResumeError(f"{path}: {name}={value!r} is not a valid value; resume from another checkpoint")
        return cls(**values)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (staging folders are hidden and skipped)."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in folder.iterdir() if (m := _NAME.match(path.name))]
    return [path for _, path in sorted(found) if (path / STATE_FILE).is_file()]


def latest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_resume(resume_from: str | Path, output_dir: Path) -> Path:
    """`"latest"` → the newest checkpoint of `output_dir`; a run folder → its newest; a checkpoint → itself."""
    if str(resume_from) == "latest":
        latest = latest_checkpoint(output_dir)
        if latest is None:
            raise ResumeError(
                f"resume_from='latest' but {Path(output_dir) / CHECKPOINTS} holds no complete checkpoint; "
                f"drop resume_from to start a new run, or point it at a checkpoint folder"
            )
        return latest
    path = Path(resume_from)
    if (path / STATE_FILE).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ResumeError(
            f"{path} is neither a checkpoint (no {STATE_FILE}) nor a run folder with checkpoints; "
            f"pass a folder such as {Path(output_dir) / CHECKPOINTS / 'step-00000100'} or 'latest'"
        )
    return latest


def rotate(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints."""
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def remove_staging_leftovers(run_dir: Path) -> None:
    """Remove half-written checkpoints a killed process left behind (hidden `.step-*` folders).

    A staging folder of a process that is still running is left alone (`quantlab.utils.atomic`).
    """
    from quantlab.utils.atomic import is_staging_of_live_process

    folder = Path(run_dir) / CHECKPOINTS
    if folder.is_dir():
        for leftover in folder.glob(".step-*"):
            if not is_staging_of_live_process(leftover):
                shutil.rmtree(leftover, ignore_errors=True)


# -- trainable parameters -------------------------------------------------------------------


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def save_trainable(model: nn.Module, path: Path) -> None:
    tensors = {name: p.detach().contiguous() for name, p in trainable_parameters(model).items()}
    save_file(tensors, str(path))


def load_trainable(model: nn.Module, path: Path) -> None:
    """Copy saved trainable parameters into `model`; the name sets must match exactly."""
    try:
        saved = load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise ResumeError(f"cannot read {path}: {error}; resume from another checkpoint") from error
    current = trainable_parameters(model)
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        raise ResumeError(
            f"{path} does not hold this model's trainable parameters "
            f"(missing {len(missing)}, e.g. {missing[:2]}; unexpected {len(unexpected)}, e.g. {unexpected[:2]})"
        )
    with torch.no_grad():
        for name, parameter in current.items():
            if saved[name].shape != parameter.shape:
                raise ResumeError(f"{name}: saved shape {tuple(saved[name].shape)}, model has {tuple(parameter.shape)}")
            parameter.copy_(saved[name])


# -- fingerprints ---------------------------------------------------------------------------


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """What identifies the model being trained: architecture, quantization, trainable layout."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    config_text = ""
    if config is not None:
        values = config.to_dict()
        for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"):
            values.pop(volatile, None)
        config_text = json.dumps(values, sort_keys=True, default=str)
    layout = sorted((name, tuple(p.shape)) for name, p in trainable_parameters(model).items())
    return {
        "model_class": type(base).__name__,
        "model_config": _digest(config_text),
        "frozen_weights": frozen_weights_digest(model),
        "trainable_parameters": len(layout),
        "trainable_layout": _digest(json.dumps(layout)),
        **adapter_settings(model),
    }


def adapter_settings(model: nn.Module) -> dict[str, Any]:
    """The PEFT adapters' options (rank, alpha, dropout, targets, ...), one fingerprint entry each."""
    settings = {}
    for adapter, config in (getattr(model, "peft_config", None) or {}).items():
        for key, value in config.to_dict().items():
            if key not in _ADAPTER_FIELDS_WITHOUT_EFFECT:
                settings[f"adapter.{adapter}.{key}"] = value
    return settings


def settings_of(obj: Any) -> dict[str, Any]:
    """A loss's settings for the fingerprint: its class and its dataclass config, if any."""
    config = getattr(obj, "config", obj)
    values = dataclasses.asdict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else {}
    return {"class": type(obj).__name__, **values}


def as_json_values(values: dict[str, Any]) -> dict[str, Any]:
    """`values` as they read back from JSON (tuples as lists, sets sorted), so saved and current compare equal."""

    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(value, key=str)
        if isinstance(value, enum.Enum):
            return value.value
        return str(value)

    return json.loads(json.dumps(values, default=plain, sort_keys=True))


def frozen_weights_digest(model: nn.Module, samples: int = 1024) -> str:
    """A hash of evenly spaced samples of every frozen tensor: tells two checkpoints of one architecture apart.

    Sampling keeps it to milliseconds on a large model; two different trainings or quantizations
    differ in nearly every element, so they differ in the samples too.
    """
    digest = hashlib.sha256()
    tensors = [(n, p) for n, p in model.named_parameters() if not p.requires_grad] + list(model.named_buffers())
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0 or flat.device.type == "meta":
            continue
        step = max(1, flat.numel() // samples)
        digest.update(name.encode())
        digest.update(flat[::step].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], checkpoint: Path) -> None:
    differences = [
        f"{key}: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    if differences:
        raise ResumeError(
            f"{checkpoint} belongs to another run: " + "; ".join(differences) + ". Resume with the same model, "
            "adapters, data and batch settings, or start a new run in another output_dir"
        )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
