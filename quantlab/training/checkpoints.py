"""Training checkpoints without pickle, checked before they are read.

A run folder holds Trainer's `checkpoint-N` folders. Each is written into a hidden temporary
sibling and renamed into place once complete (`quantlab.utils.atomic`), so an interrupted save
leaves the previous checkpoint as the latest one, and the hidden folder is never resumed from.
Inside: `trainable.safetensors` (only the parameters that train), the optimizer, scheduler,
scaler, callback and per-process RNG states as JSON + safetensors (`state_files`),
transformers' `trainer_state.json`, and `manifest.json`: the run's fingerprint and the size and
SHA-256 of every other file. A resume checks the manifest first: a file that is missing,
truncated, edited or was never written by the run (a planted `optimizer.pt`) is refused, and so
is a checkpoint of another model, adapter, data set or batch layout, with the differences named.
"""

import dataclasses
import enum
import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from quantlab.errors import QuantlabError
from quantlab.training.state_files import StateFileError, read_state

MANIFEST, TRAINABLE = "manifest.json", "trainable.safetensors"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_FIX = "resume from another checkpoint or start a new run"
# Adapter options that do not change a resumed run (the weights come from the checkpoint) or are bookkeeping.
_ADAPTER_FIELDS_WITHOUT_EFFECT = ("base_model_name_or_path", "revision", "inference_mode", "peft_version")


class ResumeError(QuantlabError, ValueError):
    """A checkpoint cannot be resumed from in this run (missing, damaged, edited, or another run's)."""


# -- where checkpoints are ------------------------------------------------------------------


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first; hidden temporaries and folders without a manifest are skipped."""
    folder = Path(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in folder.iterdir() if (m := _NAME.match(path.name))]
    return [path for _, path in sorted(found) if (path / MANIFEST).is_file()]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_resume(resume_from: str | Path | bool, output_dir: str | Path) -> Path:
    """`"latest"`/`True` → the newest checkpoint of `output_dir`; a run folder → its newest; a checkpoint → itself."""
    if resume_from is True or str(resume_from) == "latest":
        latest = latest_checkpoint(output_dir)
        if latest is None:
            raise ResumeError(
                f"resume 'latest' but {output_dir} holds no complete checkpoint; start a new run without it, "
                f"or point it at a checkpoint folder"
            )
        return latest
    path = Path(resume_from)
    if (path / MANIFEST).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ResumeError(
            f"{path} is neither a checkpoint (no {MANIFEST}) nor a run folder with checkpoints; "
            f"pass a folder such as {Path(output_dir) / 'checkpoint-100'} or 'latest'"
        )
    return latest


# -- the manifest ---------------------------------------------------------------------------


def file_digest(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def write_manifest(folder: Path, fingerprint: dict[str, Any]) -> None:
    files = {p.name: file_digest(p) for p in sorted(Path(folder).iterdir()) if p.name != MANIFEST}
    (Path(folder) / MANIFEST).write_text(json.dumps({"fingerprint": fingerprint, "files": files}, indent=1))


def verify_checkpoint(folder: Path) -> dict[str, Any]:
    """Check every file of `folder` against its manifest; returns the saved fingerprint."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ResumeError(f"cannot read {path}: {error}; {_FIX}") from error
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)):
        raise ResumeError(f"{path} is not a quantlab checkpoint manifest; {_FIX}")
    for extra in sorted({p.name for p in Path(folder).iterdir()} - set(manifest["files"]) - {MANIFEST}):
        raise ResumeError(
            f"{Path(folder) / extra} was not written with this checkpoint (a planted file, never read); "
            f"remove it or {_FIX}"
        )
    for name, expected in manifest["files"].items():
        if Path(name).name != name or name in (".", ".."):
            raise ResumeError(f"{path} lists {name!r}, which is not a file of the checkpoint; {_FIX}")
        _verify_file(Path(folder) / name, expected)
    return manifest.get("fingerprint") or {}


def _verify_file(path: Path, expected: Any) -> None:
    if not path.is_file():
        raise ResumeError(f"{path} is missing; {_FIX}")
    size = path.stat().st_size
    if not isinstance(expected, dict) or size != expected.get("bytes"):
        recorded = expected.get("bytes") if isinstance(expected, dict) else None
        raise ResumeError(f"{path} is {size} bytes but was {recorded} when saved (truncated or replaced); {_FIX}")
    if file_digest(path)["sha256"] != expected.get("sha256"):
        raise ResumeError(f"{path} does not match the checksum recorded when it was saved (damaged or edited); {_FIX}")


def read_checked_state(folder: Path, name: str) -> Any:
    """A state `write_state` stored (the manifest is verified already); unreadable content is a `ResumeError`."""
    try:
        return read_state(folder, name)
    except StateFileError as error:
        raise ResumeError(f"{error}; {_FIX}") from error


def load_into(target: Any, state: Any, source: Path) -> None:
    """`target.load_state_dict(state)`; a state of the wrong form is a damaged checkpoint, not a traceback."""
    try:
        target.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as error:
        raise ResumeError(
            f"{source} does not fit this run's {type(target).__name__} ({type(error).__name__}: {error}); {_FIX}"
        ) from error


def check_optimizer_state(optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """Refuse per-parameter state of a parameter's size but another shape (a moment of another layer)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            for key, value in optimizer.state.get(parameter, {}).items():
                moment = isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == parameter.numel()
                if moment and value.shape != parameter.shape:
                    raise ResumeError(
                        f"{checkpoint}: optimizer state {key!r} has shape {tuple(value.shape)} for a parameter "
                        f"of shape {tuple(parameter.shape)}; {_FIX}"
                    )


# -- trainable parameters and random generators ---------------------------------------------


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def save_trainable(model: nn.Module, path: Path) -> None:
    save_file({name: p.detach().contiguous() for name, p in trainable_parameters(model).items()}, str(path))


def load_trainable(model: nn.Module, path: Path) -> None:
    """Copy saved trainable parameters into `model`; the name sets and shapes must match exactly."""
    try:
        saved = load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise ResumeError(f"cannot read {path}: {error}; {_FIX}") from error
    current = trainable_parameters(model)
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        raise ResumeError(f"{path} does not hold this model's trainable parameters (missing {missing[:2]}, "
                          f"unexpected {unexpected[:2]}); {_FIX}")  # fmt: skip
    with torch.no_grad():
        for name, parameter in current.items():
            if saved[name].shape != parameter.shape:
                raise ResumeError(f"{path}: {name} has shape {tuple(saved[name].shape)}, the model "
                                  f"{tuple(parameter.shape)}; {_FIX}")  # fmt: skip
            parameter.copy_(saved[name])


def capture_rng() -> dict[str, Any]:
    """Every generator a run draws from (dropout, shuffling, user code)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Any, source: Path) -> None:
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as error:
        raise ResumeError(
            f"{source} does not hold a valid random-number state ({type(error).__name__}: {error}); {_FIX}"
        ) from error


# -- fingerprints ---------------------------------------------------------------------------


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """What identifies the model being trained: architecture, frozen weights, trainable layout, adapter options."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    values = config.to_dict() if config is not None else {}
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"):
        values.pop(volatile, None)
    layout = sorted((name, tuple(p.shape)) for name, p in trainable_parameters(model).items())
    adapters = {
        f"adapter.{adapter}.{key}": value
        for adapter, adapter_config in (getattr(model, "peft_config", None) or {}).items()
        for key, value in adapter_config.to_dict().items()
        if key not in _ADAPTER_FIELDS_WITHOUT_EFFECT
    }
    return {
        "model_class": type(base).__name__,
        "model_config": _digest(json.dumps(values, sort_keys=True, default=str)),
        "frozen_weights": frozen_weights_digest(model),
        "trainable_parameters": len(layout),
        "trainable_layout": _digest(json.dumps(layout)),
        **adapters,
    }


def frozen_weights_digest(model: nn.Module, samples: int = 1024) -> str:
    """A hash of evenly spaced samples of every frozen tensor: tells two checkpoints of one architecture apart."""
    digest = hashlib.sha256()
    tensors = [(n, p) for n, p in model.named_parameters() if not p.requires_grad] + list(model.named_buffers())
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0 or flat.device.type == "meta":
            continue
        digest.update(name.encode())
        digest.update(flat[:: max(1, flat.numel() // samples)].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def as_json_values(values: dict[str, Any]) -> dict[str, Any]:
    """`values` as they read back from JSON, so saved and current fingerprints compare equal."""

    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(value, key=str)
        if isinstance(value, enum.Enum):
            return value.value
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.asdict(value)
        return str(value)

    return json.loads(json.dumps(values, default=plain, sort_keys=True))


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
