"""The one reader of safetensors headers: every field checked against the file before anything is sized from it.

A safetensors file is an 8-byte little-endian header length, a UTF-8 JSON header, then the tensor
data. The header length is checked against the file's length (and a 100 MB cap) before the header is
read; each tensor's dtype, shape and byte range are checked against the data that follows, and the
ranges must not overlap. Only then does a caller seek, read or allocate from an entry. Each failure
is one `UnreadableFileError` naming the file and what is wrong with it.
"""

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantlab.files import UnreadableFileError

# The cap the safetensors package itself puts on a header.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"

# Bits per element of every dtype the safetensors package knows (F4 and F6 pack elements below a byte).
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

_FIX = "restore the file or save the model again"


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file: its dtype name, shape and byte range from the start of the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors file's header, validated: its raw bytes, its metadata and its tensors' entries."""

    path: Path
    raw: bytes
    metadata: dict[str, str]
    entries: dict[str, HeaderEntry]

    @property
    def data_start(self) -> int:
        """Where the tensor data begins: after the 8-byte length and the header."""
        return 8 + len(self.raw)


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    """The validated header of the safetensors file at `path`, or `UnreadableFileError` saying what is wrong."""
    path = Path(path)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        raw = _read_raw_header(path, handle, size)
    parsed = _parse_json(path, raw)
    metadata = _metadata(path, parsed.pop(METADATA_KEY, None))
    data_start, data_length = 8 + len(raw), size - 8 - len(raw)
    entries = {name: _entry(path, name, info, data_start, data_length) for name, info in parsed.items()}
    _check_no_overlap(path, entries)
    return SafetensorsHeader(path, raw, metadata, entries)


def unreadable(path: Path, what: str) -> UnreadableFileError:
    """The one-line error for a damaged safetensors file."""
    return UnreadableFileError(f"{path} is not a readable safetensors file: {what}; {_FIX}")


def _read_raw_header(path: Path, handle: Any, size: int) -> bytes:
    """The header's bytes, its length checked against the file and the cap before they are read."""
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise unreadable(path, f"it is {size} byte(s) long, shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", prefix)
    if length > size - 8:
        raise unreadable(path, f"its header length {length:,} runs past the end of the {size:,}-byte file")
    if length > MAX_HEADER_BYTES:
        raise unreadable(path, f"its header length {length:,} is over the {MAX_HEADER_BYTES:,}-byte limit")
    raw = handle.read(length)
    if len(raw) != length:
        raise unreadable(path, "the file ended while its header was read (truncated?)")
    return raw


def _parse_json(path: Path, raw: bytes) -> dict[str, Any]:
    """The header as a JSON object (UTF-8, no key twice)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise unreadable(path, f"its header is not UTF-8 (byte {error.start})") from None
    try:
        parsed = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKeyError as error:
        raise unreadable(path, f"its header names {_short(error.args[0])} twice") from None
    except (ValueError, RecursionError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise unreadable(path, f"its header is not JSON ({first_line})") from None
    if not isinstance(parsed, dict):
        raise unreadable(path, f"its header is a JSON {type(parsed).__name__}, not an object")
    return parsed


class _DuplicateKeyError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a key given twice (it could hide a second byte range)."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def _metadata(path: Path, value: Any) -> dict[str, str]:
    """`__metadata__`: absent, null, or an object of strings."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
        raise unreadable(path, f"its {METADATA_KEY} is not an object of strings")
    return value


def _entry(path: Path, name: str, info: Any, data_start: int, data_length: int) -> HeaderEntry:
    """One tensor's entry, its dtype known, its shape and byte range consistent and inside the data."""
    if not isinstance(info, dict):
        raise unreadable(path, f"tensor {_short(name)} is described by a JSON {type(info).__name__}, not an object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise unreadable(path, f"tensor {_short(name)} has unknown dtype {_short(dtype)}")
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(_is_int(dim) and dim >= 0 for dim in shape):
        raise unreadable(path, f"tensor {_short(name)} has shape {_short(shape)}, not a list of non-negative integers")
    offsets = info.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(offset) for offset in offsets)):
        raise unreadable(path, f"tensor {_short(name)} has data_offsets {_short(offsets)}, not two integers")
    start, end = offsets
    if not 0 <= start <= end <= data_length:
        where = f"bytes [{_short(start)}, {_short(end)})"
        raise unreadable(path, f"tensor {_short(name)} lies at {where} of data that is {data_length:,} byte(s) long")
    _check_size(path, f"tensor {_short(name)} ({dtype} {_short(shape)})", shape, DTYPE_BITS[dtype], end - start)
    return HeaderEntry(dtype, tuple(shape), data_start + start, data_start + end)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_size(path: Path, tensor: str, shape: list[int], bits: int, span: int) -> None:
    """The byte range holds exactly the tensor's elements; the product stops growing once it is past `span`."""
    total = 0 if 0 in shape else bits
    for dim in shape:
        total *= dim
        if total > 8 * span:
            raise unreadable(path, f"{tensor} needs more than the {span:,} byte(s) its data_offsets span")
    if total % 8:
        raise unreadable(path, f"{tensor} fills a fraction of a byte ({total} bits), which safetensors cannot store")
    if total // 8 != span:
        raise unreadable(path, f"{tensor} needs {total // 8:,} byte(s) but its data_offsets span {span:,}")


def _check_no_overlap(path: Path, entries: dict[str, HeaderEntry]) -> None:
    """No two tensors share a byte (empty tensors share nothing)."""
    ordered = sorted(entries.items(), key=lambda item: (item[1].start, item[1].end))
    reach, owner = 0, ""
    for name, entry in ordered:
        if entry.start < reach:
            raise unreadable(path, f"tensors {_short(owner)} and {_short(name)} overlap")
        if entry.end > reach:
            reach, owner = entry.end, name


def _short(value: Any) -> str:
    """`value` for a message, kept short (a header field can be long or deeply nested)."""
    if isinstance(value, list):
        shown = ", ".join(_short_scalar(item) for item in value[:6])
        return f"[{shown}{', ...' if len(value) > 6 else ''}]"
    return _short_scalar(value)


def _short_scalar(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return "[...]" if isinstance(value, list) else "{...}"
    if isinstance(value, str):
        return repr(value[:100] + ("..." if len(value) > 100 else ""))
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
