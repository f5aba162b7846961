"""The one reader of `model.safetensors.index.json`: every shard it names must be a file inside the model folder.

The index maps tensor names to shard file names, and loaders open whatever it names. So a name
must be a plain relative path (not absolute, no `..`), resolve (symlinks followed) inside the
model folder, and name an existing file. An index in a Hugging Face hub cache snapshot
(`<repo>/snapshots/<revision>/`) names links into the repository's `blobs/` folder: those are
inside it too. `check_weight_files(folder)` applies this to the folder's indexes (transformers'
`pytorch_model.bin.index.json` too) and the safetensors header checks to every safetensors file
the folder holds, headers only, before anything loads it.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from quantlab.files import UnreadableFileError
from quantlab.files.safetensors_header import read_safetensors_header

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# transformers follows this index too when a folder has no safetensors weights.
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
# Indexes of the largest models are a few MB; anything far beyond is not an index.
MAX_INDEX_BYTES = 100_000_000

_FIX = "restore the index or save the model again"


@dataclass(frozen=True)
class ShardIndex:
    """A validated shard index: its tensor -> shard map and the shards it names (sorted, each once)."""

    path: Path
    weight_map: dict[str, str]
    shards: list[Path]


def read_shard_index(path: str | os.PathLike, folder: str | os.PathLike | None = None) -> ShardIndex:
    """The index at `path` (its model folder: `folder`, default the index's own), or `UnreadableFileError`."""
    path = Path(path)
    folder = Path(folder) if folder is not None else path.parent
    weight_map = _weight_map(path, _parse_json(path))
    if not weight_map:
        raise UnreadableFileError(f"{path} names no shard (its weight_map is empty); {_FIX}")
    names = sorted(set(weight_map.values()))
    roots = _allowed_roots(path, folder)
    for name in names:
        _check_shard(path, folder, roots, name)
    return ShardIndex(path, weight_map, [folder / name for name in names])


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files a loader may read in `folder`: the index's shards (checked) and every `*.safetensors`."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    shards = read_shard_index(index, folder).shards if index.is_file() else []
    return sorted(set(shards) | {file for file in folder.glob("*.safetensors") if file.is_file()})


def check_weight_files(folder: str | os.PathLike) -> list[Path]:
    """Validate the folder's shard indexes (if any) and the header of each of its safetensors files; returns them."""
    files = weight_files(folder)
    if (Path(folder) / BIN_INDEX_FILE).is_file():
        read_shard_index(Path(folder) / BIN_INDEX_FILE, folder)
    for file in files:
        read_safetensors_header(file)
    return files


def _parse_json(path: Path) -> Any:
    """The index's JSON, its size checked before it is read."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > MAX_INDEX_BYTES:
            raise UnreadableFileError(f"{path} is not a shard index: {size:,} bytes is far too large for one; {_FIX}")
        raw = handle.read(MAX_INDEX_BYTES + 1)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise UnreadableFileError(f"{path} is not a shard index: not UTF-8 (byte {error.start}); {_FIX}") from None
    except (ValueError, RecursionError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UnreadableFileError(f"{path} is not a shard index: not JSON ({first_line}); {_FIX}") from None


def _weight_map(path: Path, parsed: Any) -> dict[str, str]:
    """The `weight_map` member: an object of tensor name -> shard name strings."""
    if not isinstance(parsed, dict):
        raise UnreadableFileError(f"{path} is not a shard index: a JSON {type(parsed).__name__}, not an object; {_FIX}")
    weight_map = parsed.get("weight_map")
    if not isinstance(weight_map, dict):
        found = "none" if weight_map is None else f"a JSON {type(weight_map).__name__}"
        raise UnreadableFileError(f"{path} is not a shard index: its weight_map is {found}, not an object; {_FIX}")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise UnreadableFileError(f"{path} maps {_quoted(tensor)} to {_quoted(shard)}, not a file name; {_FIX}")
    return weight_map


def _allowed_roots(path: Path, folder: Path) -> list[Path]:
    """Where shards may resolve: the model folder, and a hub cache snapshot's `blobs/` folder."""
    root = _resolved(path, folder, str(folder))
    roots = [root]
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        roots.append(root.parent.parent / "blobs")
    return roots


def _check_shard(path: Path, folder: Path, roots: list[Path], name: str) -> None:
    """A shard name is a plain relative path to a file that lies inside one of `roots`."""
    shown = _quoted(name)
    if "\0" in name or PurePosixPath(name).is_absolute() or PureWindowsPath(name).anchor:
        raise UnreadableFileError(f"{path} names shard {shown}, an absolute path, not a file in {folder}; {_FIX}")
    if ".." in PurePosixPath(name).parts or ".." in PureWindowsPath(name).parts:
        raise UnreadableFileError(f"{path} names shard {shown}, which lies outside the model folder; {_FIX}")
    target = _resolved(path, folder / name, name)
    if not any(target.is_relative_to(root) for root in roots):
        raise UnreadableFileError(
            f"{path} names shard {shown}, which lies outside the model folder (it resolves to {target}); {_FIX}"
        )
    if not target.is_file():
        raise UnreadableFileError(f"{path} names shard {shown}, which is missing from {folder}; {_FIX}")


def _resolved(path: Path, target: Path, name: str) -> Path:
    """`target` with every symlink followed; a link loop is a damaged folder."""
    try:
        return target.resolve()
    except (OSError, RuntimeError) as error:
        raise UnreadableFileError(f"{path} names {_quoted(name)}, which cannot be resolved ({error}); {_FIX}") from None


def _quoted(value: Any) -> str:
    """`value` quoted for a one-line message, cut to 100 characters."""
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."
