"""Training state on disk without pickle: the structure as JSON, its tensors in safetensors.

Optimizer, scheduler, gradient scaler, RNG and callback states are nested dicts, lists and
tuples of numbers, strings, tensors and numpy arrays. `write_state(state, folder, name)`
stores one as `name.json` (the structure, tensors replaced by references) beside
`name.safetensors` (the tensors); `read_state` rebuilds it. Neither format can carry code, so
a checkpoint received from someone else cannot run anything when it is resumed (torch's and
accelerate's `.bin`/`.pkl` state files are pickles). Anything else in a state is refused
when it is written, with its path in the state named.
"""

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from quantlab.errors import QuantlabError

# Markers of the JSON encoding; a dict whose keys are not all plain strings is stored as `{ITEMS: [[k, v], ...]}`.
TENSOR, ARRAY, TUPLE, ITEMS, FLOAT = "__tensor__", "__ndarray__", "__tuple__", "__items__", "__float__"
_MARKERS = {TENSOR, ARRAY, TUPLE, ITEMS, FLOAT}


class StateFileError(QuantlabError, ValueError):
    """A state file cannot be written (an unsupported value) or read back (damaged, edited, not ours)."""


def write_state(state: Any, folder: Path, name: str) -> list[Path]:
    """Store `state` as `folder/name.json` + `folder/name.safetensors`; returns both paths."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(state, tensors, name)
    json_path, tensors_path = Path(folder) / f"{name}.json", Path(folder) / f"{name}.safetensors"
    json_path.write_text(json.dumps(structure, allow_nan=False), encoding="utf-8")
    save_file(tensors, str(tensors_path))
    return [json_path, tensors_path]


def read_state(folder: Path, name: str) -> Any:
    """The state `write_state` stored under `name` in `folder`."""
    json_path, tensors_path = Path(folder) / f"{name}.json", Path(folder) / f"{name}.safetensors"
    try:
        structure = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise StateFileError(f"cannot read {json_path}: {error}") from error
    try:
        tensors = load_file(str(tensors_path))
    except (OSError, SafetensorError) as error:
        raise StateFileError(f"cannot read {tensors_path}: {error}") from error
    used: set[str] = set()
    try:
        state = _decode(structure, tensors, used, json_path)
    except (TypeError, ValueError) as error:  # an unhashable key, a dtype numpy does not know
        raise StateFileError(f"{json_path} is malformed: {error}") from error
    if used != set(tensors):
        raise StateFileError(f"{tensors_path} holds tensors {json_path.name} does not refer to")
    return state


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else {FLOAT: repr(value)}
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = value.detach().cpu().contiguous().clone()
        return {TENSOR: key}
    if isinstance(value, np.ndarray):
        key = str(len(tensors))
        tensors[key] = torch.from_numpy(value.astype(np.int64) if value.dtype == np.uint32 else value.copy())
        return {ARRAY: key, "dtype": str(value.dtype)}
    if isinstance(value, tuple):
        return {TUPLE: [_encode(item, tensors, f"{where}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(item, tensors, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and not _MARKERS & set(value):
            return {key: _encode(item, tensors, f"{where}.{key}") for key, item in value.items()}
        return {ITEMS: [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise StateFileError(
        f"{where} is a {type(value).__name__}; training state must be made of tensors, arrays, numbers, "
        f"strings, lists, tuples and dicts so it can be stored without pickle"
    )


def _decode(value: Any, tensors: dict[str, torch.Tensor], used: set[str], path: Path) -> Any:
    if isinstance(value, list):
        return [_decode(item, tensors, used, path) for item in value]
    if not isinstance(value, dict):
        return value
    marker = _MARKERS & set(value)
    if not marker:
        return {key: _decode(item, tensors, used, path) for key, item in value.items()}
    kind = marker.pop()
    content = value[kind]
    if kind in (TENSOR, ARRAY):
        if content not in tensors:
            raise StateFileError(f"{path} refers to tensor {content!r}, which its .safetensors file lacks")
        used.add(content)
        if kind == TENSOR:
            return tensors[content]
        dtype = np.dtype(str(value.get("dtype")))
        if dtype.kind not in "biuf":
            raise StateFileError(f"{path}: arrays hold numbers, not {dtype}")
        return tensors[content].numpy().astype(dtype)
    if kind == FLOAT and content in ("inf", "-inf", "nan"):
        return float(content)
    if kind == TUPLE and isinstance(content, list):
        return tuple(_decode(item, tensors, used, path) for item in content)
    if kind == ITEMS and isinstance(content, list) and all(isinstance(p, list) and len(p) == 2 for p in content):
        return {_decode(k, tensors, used, path): _decode(v, tensors, used, path) for k, v in content}
    raise StateFileError(f"{path} holds a malformed {kind} entry: {json.dumps(value)[:80]}")
