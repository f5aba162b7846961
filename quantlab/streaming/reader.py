"""Reading a safetensors checkpoint one tensor at a time, never the whole file.

A folder's `model.safetensors` (or the shards its `model.safetensors.index.json` names) is
opened once; only the headers are parsed. `tensor(name, dtype)` reads that tensor's bytes
with one positioned read into fresh memory and converts it to `dtype` (bf16, fp16 and fp32
sources), so a tensor costs memory only while the caller holds it: nothing stays mapped, and
the page cache the reads go through belongs to the system, not to the process. This is how
llama.cpp's converter reads its input; transformers' loader maps every file and keeps the pages
it touched resident.
"""

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantlab.errors import QuantlabError
from quantlab.files.safetensors_header import read_safetensors_header
from quantlab.files.shard_index import INDEX_FILE, SINGLE_FILE, read_shard_index

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class NotStreamableError(QuantlabError, ValueError):
    """A checkpoint the streamed path cannot read tensor by tensor (no safetensors files, names it cannot map)."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its file, dtype, shape and byte range from the start of the file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


class CheckpointReader:
    """The tensors of a safetensors checkpoint folder, each read on demand."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.files = checkpoint_files(self.folder)
        self.entries: dict[str, TensorEntry] = {}
        self._headers: dict[str, bytes] = {}
        for file in self.files:
            header, entries = read_header(file)
            self._headers[file.name] = header
            self.entries.update(entries)
        self._handles: dict[Path, int] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name`, read from its file now, converted to `dtype` (None: as stored)."""
        entry = self.entries[name]
        raw = torch.empty(entry.end - entry.start, dtype=torch.uint8)
        self._read_into(entry.file, entry.start, raw)
        tensor = (
            raw.view(entry.dtype).reshape(entry.shape) if raw.numel() else torch.empty(entry.shape, dtype=entry.dtype)
        )
        return tensor if dtype is None or dtype == entry.dtype else tensor.to(dtype)

    def fingerprint(self) -> dict[str, Any]:
        """Names and sizes of the files and a hash of their headers (every tensor's name, dtype, shape and
        place) plus evenly spaced samples of their data: tells another checkpoint apart without reading it all."""
        digest = hashlib.sha256()
        for file in self.files:
            digest.update(file.name.encode() + self._headers[file.name])
            size = file.stat().st_size
            for offset in range(0, size, max(1, size // 64)):
                digest.update(os.pread(self._handle(file), 4096, offset))
        return {"files": {f.name: f.stat().st_size for f in self.files}, "sha256": digest.hexdigest()}

    def close(self) -> None:
        for handle in self._handles.values():
            os.close(handle)
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handle(self, file: Path) -> int:
        if file not in self._handles:
            self._handles[file] = os.open(file, os.O_RDONLY)
        return self._handles[file]

    def _read_into(self, file: Path, offset: int, buffer: torch.Tensor) -> None:
        view = memoryview(buffer.numpy()).cast("B")
        done = 0
        while done < len(view):
            count = os.preadv(self._handle(file), [view[done:]], offset + done)
            if count <= 0:
                raise NotStreamableError(f"{file} ends before its header says it does (truncated?); restore the file")
            done += count


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files `from_pretrained` would read in `folder`, or `NotStreamableError`.

    A shard index is read with `read_shard_index`: a damaged one, or one naming a shard outside the
    folder, raises `UnreadableFileError`.
    """
    index = folder / INDEX_FILE
    if index.is_file():
        return read_shard_index(index, folder).shards
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise NotStreamableError(f"{folder} holds no {SINGLE_FILE} nor {INDEX_FILE}")


def read_header(file: Path) -> tuple[bytes, dict[str, TensorEntry]]:
    """The raw header of a safetensors file and its tensors' entries (offsets from the start of the file).

    The header is validated by `read_safetensors_header` (`UnreadableFileError` when damaged); a dtype
    safetensors knows but torch cannot view (F4, F6, C64) is `NotStreamableError`.
    """
    header = read_safetensors_header(file)
    entries = {}
    for name, entry in header.entries.items():
        dtype = DTYPES.get(entry.dtype)
        if dtype is None:
            raise NotStreamableError(f"{file}: {name} has dtype {entry.dtype}, which quantlab does not read")
        entries[name] = TensorEntry(file, dtype, entry.shape, entry.start, entry.end)
    return header.raw, entries
