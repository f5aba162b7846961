"""Writing a safetensors checkpoint tensor by tensor, in any order, with its header written first.

The names, shapes and dtypes of every stored tensor are known before anything is quantized (a
model's layout follows from its config), so the header is written up front and the file
reserved at its final size (`posix_fallocate`: a disk too small fails at the start, not after
an hour). Each tensor is then written at its place as soon as it exists, and dropped. The file
is what `safetensors.torch.save_file` writes for the same tensors, byte for byte: the same
header (metadata first, tensors in the order safetensors sorts them: wider dtypes first, then by
name) and the same data layout, split into shards named as `save_pretrained` names them.
"""

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from quantlab.streaming.reader import INDEX_FILE, NAMES, SINGLE_FILE

# safetensors' order of dtypes; a file lists wider ones first (`safetensors` sorts by it, descending)
_ORDER = [
    "BOOL",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "F64",
    "I64",
    "U64",
]
DEFAULT_SHARD_BYTES = 50 * 10**9  # save_pretrained's default max_shard_size ("50GB")


@dataclass(frozen=True)
class Slot:
    """Where one tensor goes: its shard file and byte range from the start of that file."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def shard_plan(
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]], metadata: dict[str, str], max_shard_bytes: int
) -> tuple[dict[str, bytes], dict[str, Slot]]:
    """Each shard's header and each tensor's slot, splitting as `save_pretrained` does (in safetensors order,
    a new shard when the next tensor would overflow `max_shard_bytes`)."""
    order = sorted(tensors, key=lambda name: (-_ORDER.index(NAMES[tensors[name][1]]), name))
    shards: list[list[str]] = [[]]
    size = 0
    for name in order:
        nbytes = _nbytes(*tensors[name])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    names = [SINGLE_FILE] if len(shards) == 1 else [_shard_name(i, len(shards)) for i in range(len(shards))]
    headers, slots = {}, {}
    for file, members in zip(names, shards, strict=True):
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for name in members:
            shape, dtype = tensors[name]
            header[name] = {
                "dtype": NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + _nbytes(shape, dtype)],
            }
            offset += _nbytes(shape, dtype)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        headers[file] = encoded
        base = 8 + len(encoded)
        for name in members:
            start, end = header[name]["data_offsets"]  # type: ignore[index]
            slots[name] = Slot(file, tensors[name][1], tuple(tensors[name][0]), base + start, base + end)
    return headers, slots


class SafetensorsWriter:
    """Shard files laid out by `shard_plan`, filled one tensor at a time."""

    def __init__(self, folder: Path, headers: dict[str, bytes], slots: dict[str, Slot]) -> None:
        self.folder, self.headers, self.slots = folder, headers, slots
        self._handles: dict[str, int] = {}

    def create(self) -> None:
        """Write every shard's header and reserve its full size on disk."""
        for file, header in self.headers.items():
            handle = self._handle(file, create=True)
            os.ftruncate(handle, 0)
            os.pwrite(handle, struct.pack("<Q", len(header)) + header, 0)
            _reserve(handle, self._size(file))

    def matches_files(self) -> bool:
        """Whether the shards on disk have this plan's headers and sizes (a run to resume wrote them)."""
        for file, header in self.headers.items():
            path = self.folder / file
            if not path.is_file() or path.stat().st_size != self._size(file):
                return False
            with open(path, "rb") as handle:
                if handle.read(8 + len(header)) != struct.pack("<Q", len(header)) + header:
                    return False
        return True

    def write(self, name: str, tensor: torch.Tensor) -> str:
        """Write `tensor` at its slot; returns the SHA-256 of its bytes (for the resume manifest)."""
        slot = self.slots[name]
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise ValueError(f"{name} is {tensor.dtype} {list(tensor.shape)}, its slot {slot.dtype} {list(slot.shape)}")
        data = _bytes(tensor)
        done = 0
        while done < len(data):  # a large write may be cut short
            done += os.pwrite(self._handle(slot.file), data[done:], slot.start + done)
        return hashlib.sha256(data).hexdigest()

    def read_digest(self, name: str) -> str:
        """The SHA-256 of the bytes now stored at `name`'s slot."""
        slot = self.slots[name]
        data = os.pread(self._handle(slot.file), slot.end - slot.start, slot.start)
        return hashlib.sha256(data).hexdigest()

    def read(self, name: str) -> torch.Tensor:
        """The tensor stored at `name`'s slot."""
        slot = self.slots[name]
        data = bytearray(os.pread(self._handle(slot.file), slot.end - slot.start, slot.start))
        if not data:
            return torch.empty(slot.shape, dtype=slot.dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(slot.dtype).reshape(slot.shape).clone()

    def sync(self) -> None:
        for handle in self._handles.values():
            os.fdatasync(handle)

    def write_index(self, total_parameters: int) -> None:
        """`model.safetensors.index.json` as `save_pretrained` writes it, when there are several shards."""
        if len(self.headers) == 1:
            return
        index = {
            "metadata": {
                "total_parameters": total_parameters,
                "total_size": sum(s.end - s.start for s in self.slots.values()),
            },
            "weight_map": {name: slot.file for name, slot in self.slots.items()},
        }
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    def close(self) -> None:
        for handle in self._handles.values():
            os.close(handle)
        self._handles.clear()

    def _size(self, file: str) -> int:
        header = self.headers[file]
        return max((s.end for s in self.slots.values() if s.file == file), default=8 + len(header))

    def _handle(self, file: str, create: bool = False) -> int:
        if file not in self._handles:
            flags = os.O_RDWR | (os.O_CREAT if create else 0)
            self._handles[file] = os.open(self.folder / file, flags, 0o644)
        return self._handles[file]


def _reserve(handle: int, size: int) -> None:
    """Allocate `size` bytes now, so a full disk shows before the work; file systems without it grow sparsely."""
    try:
        os.posix_fallocate(handle, 0, size)
    except OSError as error:
        if error.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: not supported here
            raise
        os.ftruncate(handle, size)


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a contiguous CPU tensor's own memory)."""
    tensor = tensor.detach().contiguous().cpu()
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def _shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"
