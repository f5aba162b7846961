"""`check_gguf_file`: walk a GGUF file's whole header, with every count and length checked before it is used.

transformers' GGUF reader (and gguf-py's) trusts the file: a cut download ends in a `struct.error`,
a corrupt count of 2**62 loops or allocates until the machine gives up. This walk reads the header
(magic, version, metadata, tensor table) in bounded pieces, compares each count or length against
the bytes left in the file before reading or sizing anything from it, and checks that every
tensor's data lies inside the file. It reads only the header, so a 100 MB model checks in a
fraction of a second. Each fault is one `UnreadableFileError` naming the file, what is wrong and
at which byte.

Layout (little-endian): b"GGUF", uint32 version (2 or 3), uint64 tensor count, uint64 metadata
count; each metadata entry is a string key, a uint32 value type and the value (an array is a
uint32 element type, a uint64 count and the elements); each tensor is a string name, a uint32
dimension count, that many uint64 dimensions, a uint32 ggml type and a uint64 offset into the data
section, which starts at the first multiple of `general.alignment` (default 32) after the table.
A string is a uint64 byte length and that many bytes of UTF-8.
"""

import codecs
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from quantlab.errors import QuantlabError
from quantlab.files import UnreadableFileError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_NAME_BYTES = 64 * 1024  # a metadata key or a tensor name
MAX_ARRAY_DEPTH = 4  # arrays of arrays: no reader needs more, and deeper nesting only costs recursion
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
FIX = "re-download it, or export it again from the original model"

# Value types and the size of one value; 8 (string) and 9 (array) have no fixed size.
STRING, ARRAY, UINT32 = 8, 9, 4
VALUE_WIDTHS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
VALUE_TYPE_COUNT = 13
# The fewest bytes an element of each kind can take: a string is at least its length, an array its type and count.
MIN_ELEMENT_BYTES = {**VALUE_WIDTHS, STRING: 8, ARRAY: 12}
MIN_ENTRY_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, dimension count, one dimension, ggml type, offset

_CHUNK = 256 * 1024  # how much of the file one read takes
_PIECE = 8 * 1024  # how much of a long string is decoded at a time (up to 4 bytes of text per byte)
_U32, _U64, _HEADER = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<4sIQQ")

# What a read is for, in an error message: text, or a function that makes it (only called on a fault).
Description = str | Callable[[], str]


@dataclass(frozen=True)
class GGUFSummary:
    """What the header says: its version and counts, the model's architecture, where the tensor data starts."""

    version: int
    tensor_count: int
    kv_count: int
    architecture: str | None
    alignment: int
    data_offset: int


class _Damage(Exception):
    """A fault in the header, at a byte offset; `check_gguf_file` turns it into one UnreadableFileError."""

    def __init__(self, what: str, offset: int) -> None:
        super().__init__(what)
        self.what, self.offset = what, offset


def check_gguf_file(path: str | os.PathLike) -> GGUFSummary:
    """Walk the header of the GGUF file at `path`; raise UnreadableFileError if anything in it is damaged.

    Checks the magic and version, every metadata entry (types known, strings UTF-8 within the file,
    array counts that fit in the bytes left, unique keys), `general.alignment`, and every tensor
    (a unique UTF-8 name, 1 to 4 dimensions, a ggml type the `gguf` package knows, whole blocks
    along the first dimension, an aligned offset, data that ends inside the file and shares no
    bytes with another tensor's), and that the file does not go on past the last tensor's data
    (what a tensor count cut down by corruption leaves behind).
    """
    sizes = _quant_sizes(path)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        try:
            return _Walk(_Cursor(handle, size), sizes).header()
        except _Damage as damage:
            raise UnreadableFileError(
                f"{path} is not a readable GGUF file: {damage.what} (at byte {damage.offset} of {size}); {FIX}"
            ) from None


def _quant_sizes(path: str | os.PathLike) -> dict[int, tuple[int, int]]:
    """`{ggml type id: (elements per block, bytes per block)}` from the `gguf` package, which knows every type."""
    try:
        import gguf
    except ImportError as error:
        raise QuantlabError(
            f"reading {path} needs the 'gguf' package; pip install 'quantlab[models]' installs it"
        ) from error
    return {int(kind): sizes for kind, sizes in gguf.GGML_QUANT_SIZES.items()}


class _Cursor:
    """Sequential reads from a file of known size, each checked against the bytes left before it reads.

    The file is read in pieces of at most `_CHUNK` bytes, and strings the walk does not keep are
    checked in pieces of `_PIECE`: memory stays bounded whatever lengths the file claims.
    """

    def __init__(self, handle: BinaryIO, size: int) -> None:
        self.handle, self.size, self.offset = handle, size, 0
        self.buffer, self.start = b"", 0  # `buffer` holds the file's bytes from offset `start`

    @property
    def remaining(self) -> int:
        return self.size - self.offset

    def require(self, count: int, what: Description) -> None:
        """Fail unless `count` more bytes are left in the file, for `what`."""
        if count > self.remaining:
            left = f"only {self.remaining} are left" if self.remaining else "the file ends there"
            raise _Damage(f"{_text(what)} needs {count} bytes but {left} (cut short, or a corrupt length)", self.offset)

    def take(self, count: int, what: Description) -> memoryview:
        """The next `count` bytes (a view into the read buffer); `count` is small: a field, a name, a piece."""
        self.require(count, what)
        index = self.offset - self.start
        if index + count > len(self.buffer):
            self.buffer = b""  # let the old buffer go before the next one is read
            self.handle.seek(self.offset)
            self.buffer = self.handle.read(min(max(count, _CHUNK), self.remaining))
            self.start, index = self.offset, 0
            if len(self.buffer) < count:
                raise _Damage(f"{_text(what)}: the file became shorter while it was read", self.offset)
        self.offset += count
        return memoryview(self.buffer)[index : index + count]

    def skip(self, count: int, what: Description) -> None:
        self.require(count, what)
        self.offset += count

    def u32(self, what: Description) -> int:
        return _U32.unpack(self.take(4, what))[0]

    def u64(self, what: Description) -> int:
        return _U64.unpack(self.take(8, what))[0]

    def string(self, what: Description, limit: int = MAX_NAME_BYTES) -> str:
        """A length-prefixed UTF-8 string of at most `limit` bytes, as text."""
        start = self.offset
        length = self.u64(lambda: f"the length of {_text(what)}")
        if length > limit:
            raise _Damage(f"{_text(what)} is {length} bytes long, over the limit of {limit}", start)
        try:
            return str(self.take(length, what), "utf-8")
        except UnicodeDecodeError:
            raise _Damage(f"{_text(what)} is not valid UTF-8", start) from None

    def skip_string(self, what: Description) -> None:
        """Step over a length-prefixed string of any length the file holds, checking it is UTF-8 piece by piece."""
        start = self.offset
        length = self.u64(lambda: f"the length of {_text(what)}")
        self.require(length, what)
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            while length:
                piece = min(length, _PIECE)
                length -= piece
                decoder.decode(self.take(piece, what), final=not length)
        except UnicodeDecodeError:
            raise _Damage(f"{_text(what)} is not valid UTF-8", start) from None

    def strings(self, count: int, what: Callable[[int], str]) -> None:
        """Step over `count` strings (an array's elements; `what(i)` names the i-th), checking each is UTF-8.

        A vocabulary holds tens of thousands: the short ones wholly inside the read buffer are checked
        in a tight loop, the rest (and any fault) go through `skip_string`.
        """
        index = 0
        while index < count:
            index = self._buffered_strings(index, count)
            if index < count:
                self.skip_string(lambda: what(index))  # noqa: B023 (called at once or never)
                index += 1

    def _buffered_strings(self, index: int, count: int) -> int:
        """Check strings from the `index`-th on while they are short and in the buffer; the index it stopped at."""
        buffer, at = self.buffer, self.offset - self.start
        end = len(buffer)
        with memoryview(buffer) as view:
            while index < count and at + 8 <= end:
                length = _U64.unpack_from(buffer, at)[0]
                if length > _PIECE or at + 8 + length > end:
                    break
                try:
                    str(view[at + 8 : at + 8 + length], "utf-8")
                except UnicodeDecodeError:
                    break
                at += 8 + length
                index += 1
        self.offset = self.start + at
        return index


class _Walk:
    """The walk over one header: magic and counts, metadata entries, tensor table, tensor extents."""

    def __init__(self, cursor: _Cursor, quant_sizes: dict[int, tuple[int, int]]) -> None:
        self.cursor, self.quant_sizes = cursor, quant_sizes
        self.keys: set[str] = set()
        self.architecture: str | None = None
        self.alignment = DEFAULT_ALIGNMENT

    def header(self) -> GGUFSummary:
        """The summary of a sound header; `_Damage` at the first fault."""
        cursor = self.cursor
        if cursor.size < _HEADER.size:
            magic = cursor.take(min(cursor.size, 4), "the magic").tobytes()
            if MAGIC.startswith(magic):
                raise _Damage(f"the file is {cursor.size} bytes, shorter than the {_HEADER.size}-byte header", 0)
            raise _Damage(f"it starts with {magic!r}, not {MAGIC!r}", 0)
        magic, version, tensor_count, kv_count = _HEADER.unpack(cursor.take(_HEADER.size, "the header"))
        _check_magic_and_version(magic, version)
        self._check_counts(tensor_count, kv_count)
        for index in range(kv_count):
            self._entry(index, kv_count)
        tensors = [self._tensor_info(index, tensor_count) for index in range(tensor_count)]
        data_offset = _aligned(cursor.offset, self.alignment)
        self._check_tensors(tensors, data_offset)
        return GGUFSummary(version, tensor_count, kv_count, self.architecture, self.alignment, data_offset)

    def _check_counts(self, tensor_count: int, kv_count: int) -> None:
        """Fail at once on counts the rest of the file cannot hold, before anything loops over them."""
        least = kv_count * MIN_ENTRY_BYTES + tensor_count * MIN_TENSOR_BYTES
        if least > self.cursor.remaining:
            raise _Damage(
                f"the header counts {kv_count} metadata entries and {tensor_count} tensors, which need at least "
                f"{least} bytes, but only {self.cursor.remaining} follow (cut short, or a corrupt count)",
                8,
            )

    def _check_count(self, count: int, least: int, what: str) -> None:
        """Fail unless `count` items of at least `least` bytes each fit in the bytes left."""
        if count * least > self.cursor.remaining:
            raise _Damage(
                f"{what} needs at least {count * least} bytes, but only {self.cursor.remaining} are left "
                f"(cut short, or a corrupt count)",
                self.cursor.offset,
            )

    def _entry(self, index: int, count: int) -> None:
        """One metadata entry: a unique key, its value type, its value."""
        cursor = self.cursor
        start = cursor.offset
        key = cursor.string(f"metadata key {index + 1} of {count}", MAX_NAME_BYTES)
        shown = _shown(key)
        if key in self.keys:
            raise _Damage(f"metadata key {shown} appears twice", start)
        self.keys.add(key)
        kind = self._value_type(f"the value type of {shown}")
        if key == "general.alignment":
            self._alignment(kind)
        elif key == "general.architecture" and kind == STRING:
            self.architecture = cursor.string(f"the value of {shown}")  # kept, so bounded like a key
        else:
            self._value(kind, shown)

    def _value_type(self, what: str) -> int:
        offset = self.cursor.offset
        kind = self.cursor.u32(what)
        if kind >= VALUE_TYPE_COUNT:
            raise _Damage(f"{what} is {kind}, not one of GGUF's value types 0-{VALUE_TYPE_COUNT - 1}", offset)
        return kind

    def _value(self, kind: int, shown: str) -> None:
        """Step over one value of type `kind` (of the key `shown`), checking strings and arrays."""
        if kind in VALUE_WIDTHS:
            self.cursor.skip(VALUE_WIDTHS[kind], f"the value of {shown}")
        elif kind == STRING:
            self.cursor.skip_string(f"the string value of {shown}")
        else:
            self._array(shown, depth=0)

    def _array(self, shown: str, depth: int) -> None:
        """An array: its element type, a count that fits in the bytes left, then each element."""
        cursor = self.cursor
        if depth >= MAX_ARRAY_DEPTH:
            raise _Damage(f"the value of {shown} nests arrays more than {MAX_ARRAY_DEPTH} deep", cursor.offset)
        element = self._value_type(f"the element type of the array {shown}")
        count = cursor.u64(f"the length of the array {shown}")
        self._check_count(count, MIN_ELEMENT_BYTES[element], f"the array {shown} of {count} elements")
        if element in VALUE_WIDTHS:
            cursor.skip(count * VALUE_WIDTHS[element], f"the array {shown}")
        elif element == STRING:
            cursor.strings(count, lambda index: f"element {index} of the array {shown}")
        else:
            for _ in range(count):
                self._array(shown, depth + 1)

    def _alignment(self, kind: int) -> None:
        """`general.alignment`: a uint32 power of two, as gguf-py and llama.cpp require."""
        offset = self.cursor.offset
        if kind != UINT32:
            raise _Damage(f"general.alignment has value type {kind}, not uint32 ({UINT32})", offset)
        alignment = self.cursor.u32("general.alignment")
        if alignment == 0 or alignment & (alignment - 1):
            raise _Damage(f"general.alignment is {alignment}, not a power of two", offset)
        self.alignment = alignment

    def _tensor_info(self, index: int, count: int) -> "_TensorInfo":
        """One entry of the tensor table: name, dimensions, ggml type, offset into the data section."""
        cursor = self.cursor
        start = cursor.offset
        name = cursor.string(f"the name of tensor {index + 1} of {count}", MAX_NAME_BYTES)
        shown = _shown(name)
        dims_at = cursor.offset
        n_dims = cursor.u32(f"the dimension count of tensor {shown}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Damage(f"tensor {shown} has {n_dims} dimensions, not 1 to {MAX_DIMS}", dims_at)
        dims = struct.unpack(f"<{n_dims}Q", cursor.take(8 * n_dims, f"the dimensions of tensor {shown}"))
        type_at = cursor.offset
        ggml_type = cursor.u32(f"the ggml type of tensor {shown}")
        if ggml_type not in self.quant_sizes:
            raise _Damage(f"tensor {shown} has ggml type {ggml_type}, which the gguf package does not know", type_at)
        offset = cursor.u64(f"the data offset of tensor {shown}")
        return _TensorInfo(name, start, dims, ggml_type, offset)

    def _check_tensors(self, tensors: list["_TensorInfo"], data_offset: int) -> None:
        """Unique names, each tensor's data inside the file, and no data past the last tensor's."""
        names: set[str] = set()
        extents = []
        for tensor in tensors:
            if tensor.name in names:
                raise _Damage(f"tensor name {tensor.shown} appears twice", tensor.at)
            names.add(tensor.name)
            extents.append((data_offset + tensor.offset, self._tensor_end(tensor, data_offset), tensor))
        data_end = _check_no_overlap(sorted(extents, key=lambda extent: extent[:2]), data_offset)
        if self.cursor.size > _aligned(data_end, self.alignment):
            raise _Damage(
                f"the file goes on {self.cursor.size - data_end} bytes past the data of its {len(tensors)} tensors "
                f"(a corrupt tensor count, or bytes added to the file)",
                data_end,
            )

    def _tensor_end(self, tensor: "_TensorInfo", data_offset: int) -> int:
        """Where the tensor's data ends: whole blocks of its type, from an aligned offset, inside the file."""
        block, block_bytes = self.quant_sizes[tensor.ggml_type]
        if tensor.dims[0] % block:
            raise _Damage(
                f"tensor {tensor.shown} has rows of {tensor.dims[0]} values, not a whole number of "
                f"{block}-value blocks of its ggml type {tensor.ggml_type}",
                tensor.at,
            )
        if tensor.offset % self.alignment:
            raise _Damage(
                f"tensor {tensor.shown} starts at data offset {tensor.offset}, "
                f"not a multiple of the alignment {self.alignment}",
                tensor.at,
            )
        elements = 1
        for dim in tensor.dims:
            elements *= dim
        end = data_offset + tensor.offset + elements // block * block_bytes
        if end > self.cursor.size:
            raise _Damage(
                f"tensor {tensor.shown} ({'x'.join(map(str, tensor.dims))}) ends at byte {end}, "
                f"past the end of the file (cut short, or a corrupt offset or shape)",
                tensor.at,
            )
        return end


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    at: int  # where its entry in the tensor table starts
    dims: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def shown(self) -> str:
        return _shown(self.name)


def _check_magic_and_version(magic: bytes, version: int) -> None:
    if magic != MAGIC:
        raise _Damage(f"it starts with {magic!r}, not {MAGIC!r}", 0)
    if version in VERSIONS:
        return
    if int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
        raise _Damage("it is a big-endian GGUF file, which transformers' GGUF reader does not read", 4)
    if version == 1:
        raise _Damage("it is GGUF version 1 (32-bit counts), which no current reader supports", 4)
    raise _Damage(f"it is GGUF version {version}; quantlab reads versions 2 and 3", 4)


def _text(what: Description) -> str:
    return what() if callable(what) else what


def _check_no_overlap(extents: list[tuple[int, int, _TensorInfo]], data_offset: int) -> int:
    """Fail if two tensors' data share bytes (no writer does that: one offset is corrupt); return where data ends."""
    end, previous = data_offset, None
    for start, stop, tensor in extents:
        if start < end and stop > start:
            raise _Damage(f"the data of tensors {previous.shown} and {tensor.shown} overlap", tensor.at)
        if stop > end:
            end, previous = stop, tensor
    return end


def _aligned(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _shown(name: str, limit: int = 80) -> str:
    """A key or tensor name for a one-line message: quoted, control characters escaped, a long one shortened."""
    return repr(name) if len(name) <= limit else f"{name[:limit]!r}..."
