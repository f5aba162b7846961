"""What a checkpoint holds besides the trainable weights, and the proof that it is intact.

The loop's state is written with `quantlab.training.state_files` (JSON + safetensors, no
pickle): `optimizer`, `scheduler`, `scaler` (fp16 only), `callbacks` and one
`random_states_<rank>` per process (Python's, numpy's, torch's and each GPU's generator).
Once every file is written, the size and SHA-256 of each go into `trainer_state.json`; a
resume checks them before reading anything else, so a truncated, damaged or edited state
file is refused instead of resuming a run that is silently no longer the same.
"""

import hashlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantlab.errors import QuantlabError
from quantlab.training.state_files import StateFileError, read_state, state_files

OPTIMIZER, SCHEDULER, SCALER, CALLBACKS = "optimizer", "scheduler", "scaler", "callbacks"
_CHUNK = 1 << 20


class DamagedCheckpointError(QuantlabError, ValueError):
    """A checkpoint's file is missing, truncated or not the one written at save time."""


def rng_name(rank: int) -> str:
    return f"random_states_{rank}"


def read(folder: Path, name: str, manifest: dict[str, Any]) -> Any:
    """The state stored under `name`, after checking its files against the manifest."""
    for file in state_files(name):
        verify_file(folder, file, manifest)
    try:
        return read_state(folder, name)
    except StateFileError as error:
        raise DamagedCheckpointError(f"{error}; resume from another checkpoint or start a new run") from error


# -- the manifest ---------------------------------------------------------------------------


def file_digest(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def manifest(folder: Path, exclude: str) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file in `folder` but `exclude` (the file the manifest goes into)."""
    return {path.name: file_digest(path) for path in sorted(Path(folder).iterdir()) if path.name != exclude}


def verify_file(folder: Path, name: str, manifest: dict[str, Any]) -> None:
    """Refuse `folder/name` unless it is exactly the file recorded at save time."""
    path = Path(folder) / name
    expected = manifest.get(name)
    if not isinstance(expected, dict):
        raise DamagedCheckpointError(
            f"{path} is not listed in the checkpoint's manifest; resume from another checkpoint"
        )
    if not path.is_file():
        raise DamagedCheckpointError(f"{path} is missing; resume from another checkpoint or start a new run")
    size = path.stat().st_size
    if size != expected.get("bytes"):
        raise DamagedCheckpointError(
            f"{path} is {size} bytes but was {expected.get('bytes')} when saved (truncated or replaced); "
            f"resume from another checkpoint or start a new run"
        )
    if file_digest(path)["sha256"] != expected.get("sha256"):
        raise DamagedCheckpointError(
            f"{path} does not match the checksum recorded when it was saved (damaged or edited); "
            f"resume from another checkpoint or start a new run"
        )


def check_optimizer_state(optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """Refuse per-parameter state of a parameter's size but another shape (a moment of another layer)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            for key, value in optimizer.state.get(parameter, {}).items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim() > 0
                    and value.numel() == parameter.numel()
                    and value.shape != parameter.shape
                ):
                    raise DamagedCheckpointError(
                        f"{checkpoint}: optimizer state {key!r} has shape {tuple(value.shape)} for a parameter of "
                        f"shape {tuple(parameter.shape)}; resume from another checkpoint or start a new run"
                    )


# -- random number generators ---------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """Every generator the loop draws from (dropout, shuffling, user code)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Any, source: Path) -> None:
    """Set every generator from `capture_rng`'s dict; a state of the wrong form is refused."""
    try:
        random.setstate(_as_tuple(state["python"]))
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if torch.cuda.is_available():
            if "cuda" not in state:
                raise KeyError("cuda")
            torch.cuda.set_rng_state_all(state["cuda"])
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as error:
        raise DamagedCheckpointError(
            f"{source} does not hold a valid random-number state ({type(error).__name__}: {error}); "
            f"resume from another checkpoint or start a new run"
        ) from error


def _as_tuple(python_state: Any) -> tuple:
    version, internal, gauss = python_state
    return (version, tuple(internal), gauss)
