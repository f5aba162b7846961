"""The safetensors header reader accepts what safetensors writes and refuses any damage in one line, cheaply.

Real files (a tiny Llama saved by transformers, safetensors' own writer with every torch dtype,
the bundled MiniLM) read to the entries safetensors itself reports. Named damage cases each raise
`UnreadableFileError` naming the file. A seeded fuzz run truncates and overwrites a small file
and checks every outcome: a correct read or `UnreadableFileError`, never another exception, never
a slow call, and never an allocation beyond the file's own size.
"""

import json
import os
import random
import re
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantlab.errors import QuantlabError
from quantlab.files import UnreadableFileError
from quantlab.files.safetensors_header import DTYPE_BITS, SafetensorsHeader, read_safetensors_header
from quantlab.testing import tiny_llama, tiny_model_dir

# What a call may allocate beyond the file's size: the read buffer, the parsed header's objects, the error.
ALLOCATION_SLACK = 32 * 1024


def _small_file(path: Path) -> Path:
    """A header of a few hundred bytes over a few KiB of data: several dtypes, a scalar, an empty tensor."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(16, 32, generator=generator),
        "a.bias": torch.randn(16, generator=generator).half(),
        "b.weight": torch.randn(24, 24, generator=generator).bfloat16(),
        "b.codes": torch.randint(-128, 127, (32, 16), generator=generator, dtype=torch.int8),
        "b.mask": torch.rand(40, generator=generator) > 0.5,
        "c.index": torch.arange(12, dtype=torch.int64),
        "c.scalar": torch.tensor(3.5),
        "c.empty": torch.zeros(0, 4),
    }
    save_file(tensors, path, metadata={"format": "pt", "note": "tiny"})
    return path


def _write_raw(path: Path, header: bytes | dict, data: bytes = b"", length: int | None = None) -> Path:
    """A file of an 8-byte `length` (default: the header's), the header (a dict is dumped as JSON) and `data`."""
    raw = json.dumps(header).encode() if isinstance(header, dict) else header
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _agrees_with_safetensors(header: SafetensorsHeader, path: Path) -> None:
    """Names, dtypes, shapes and bytes are those safetensors reads."""
    tensors = load_file(path)
    with safe_open(path, "pt") as handle:
        assert header.metadata == (handle.metadata() or {})
        assert sorted(header.entries) == sorted(handle.keys())
        for name, entry in header.entries.items():
            piece = handle.get_slice(name)
            assert (entry.dtype, list(entry.shape)) == (piece.get_dtype(), piece.get_shape())
    content = path.read_bytes()
    for name, entry in header.entries.items():
        assert (
            content[entry.start : entry.end] == tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        )


# -- real files ---------------------------------------------------------------------------------


def test_a_model_saved_by_transformers_reads(tmp_path):
    directory = tiny_model_dir(tiny_llama(), tmp_path / "tiny")
    header = read_safetensors_header(directory / "model.safetensors")
    assert len(header.entries) == 21 and header.metadata == {"format": "pt"}
    _agrees_with_safetensors(header, directory / "model.safetensors")


def test_every_torch_dtype_safetensors_writes_reads(tmp_path):
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16]
    dtypes += [torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16]
    dtypes += [torch.uint32, torch.uint64, torch.complex64]
    tensors = {str(dtype): torch.ones(3, 2).to(dtype) for dtype in dtypes}
    save_file(tensors, tmp_path / "all.safetensors")
    header = read_safetensors_header(tmp_path / "all.safetensors")
    assert {entry.dtype for entry in header.entries.values()} <= set(DTYPE_BITS)
    _agrees_with_safetensors(header, tmp_path / "all.safetensors")


def test_the_small_fuzz_file_reads(tmp_path):
    path = _small_file(tmp_path / "small.safetensors")
    header = read_safetensors_header(path)
    assert 200 < len(header.raw) < 1000 and 3000 < path.stat().st_size - header.data_start < 6000
    assert header.entries["c.scalar"].shape == () and header.entries["c.empty"].nbytes == 0
    _agrees_with_safetensors(header, path)


def test_sub_byte_dtypes_read_when_whole_bytes(tmp_path):
    header = {"f4": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}
    header["f6"] = {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [3, 6]}
    read = read_safetensors_header(_write_raw(tmp_path / "packed.safetensors", header, bytes(6)))
    assert (read.entries["f4"].nbytes, read.entries["f6"].nbytes) == (3, 3)


@pytest.mark.slow
def test_minilm_reads():
    from quantlab.assets.models import minilm_dir

    try:
        path = minilm_dir() / "model.safetensors"
    except QuantlabError as error:
        pytest.skip(str(error))
    _agrees_with_safetensors(read_safetensors_header(path), path)


# -- named damage -------------------------------------------------------------------------------

_F32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


def _entries(*entries: dict, metadata: object = None) -> dict:
    header = {f"t{index}": entry for index, entry in enumerate(entries)}
    return header if metadata is None else {"__metadata__": metadata, **header}


def _sparse_header_over_the_limit(path: Path) -> None:
    """A header length just over the cap in a file that long (sparse: nothing is written but the length)."""
    _write_raw(path, b"", length=100_000_001)
    os.truncate(path, 8 + 100_000_001)


DAMAGE = {
    "shorter than 8 bytes": (lambda p: p.write_bytes(b"\x10\x00\x00"), "shorter than the 8-byte header length"),
    "header length 2**63": (lambda p: _write_raw(p, _entries(_F32), bytes(16), 2**63), "runs past the end"),
    "header length past the end": (lambda p: _write_raw(p, _entries(_F32), bytes(16), 200), "runs past the end"),
    "header over 100 MB": (_sparse_header_over_the_limit, "over the 100,000,000-byte limit"),
    "not UTF-8": (lambda p: _write_raw(p, b'{"\xff": 1}'), "not UTF-8"),
    "not JSON": (lambda p: _write_raw(p, b"{not json", bytes(16)), "is not JSON"),
    "deeply nested JSON": (lambda p: _write_raw(p, b"[" * 200_000 + b"]" * 200_000), "is not JSON"),
    "JSON list": (lambda p: _write_raw(p, b"[]", bytes(16)), "a JSON list, not an object"),
    "key given twice": (lambda p: _write_raw(p, b'{"t0": {}, "t0": {}}'), "names 't0' twice"),
    "metadata not strings": (lambda p: _write_raw(p, _entries(metadata={"n": 1})), "__metadata__ is not an object"),
    "entry not an object": (lambda p: _write_raw(p, {"t0": [1, 2]}), "described by a JSON list"),
    "unknown dtype": (lambda p: _write_raw(p, _entries({**_F32, "dtype": "F7"}), bytes(16)), "unknown dtype 'F7'"),
    "negative shape": (
        lambda p: _write_raw(p, _entries({**_F32, "shape": [-2, -2]}), bytes(16)),
        "not a list of non-negative integers",
    ),
    "shape of floats": (
        lambda p: _write_raw(p, _entries({**_F32, "shape": [2.0, 2]}), bytes(16)),
        "not a list of non-negative integers",
    ),
    "offsets missing": (
        lambda p: _write_raw(p, _entries({"dtype": "F32", "shape": [1]}), bytes(4)),
        "not two integers",
    ),
    "offsets past the end": (
        lambda p: _write_raw(p, _entries({**_F32, "data_offsets": [0, 16]}), bytes(12)),
        "lies at bytes [0, 16) of data that is 12 byte(s) long",
    ),
    "offsets reversed": (lambda p: _write_raw(p, _entries({**_F32, "data_offsets": [16, 0]}), bytes(16)), "lies at"),
    "negative offset": (lambda p: _write_raw(p, _entries({**_F32, "data_offsets": [-4, 12]}), bytes(16)), "lies at"),
    "end - start not the shape": (
        lambda p: _write_raw(p, _entries({**_F32, "shape": [2, 3]}), bytes(16)),
        "needs more than the 16 byte(s)",
    ),
    "end - start more than the shape": (
        lambda p: _write_raw(p, _entries({**_F32, "shape": [3]}), bytes(16)),
        "needs 12 byte(s) but its data_offsets span 16",
    ),
    "a fraction of a byte": (
        lambda p: _write_raw(p, _entries({"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}), bytes(2)),
        "fraction of a byte",
    ),
    "a huge shape": (
        lambda p: _write_raw(p, _entries({**_F32, "shape": [2**62] * 1000}), bytes(16)),
        "needs more than the 16 byte(s)",
    ),
    "overlapping ranges": (
        lambda p: _write_raw(p, _entries(_F32, {**_F32, "data_offsets": [8, 24]}), bytes(24)),
        "tensors 't0' and 't1' overlap",
    ),
    "one range inside another": (
        lambda p: _write_raw(
            p,
            _entries(
                {**_F32, "shape": [4, 2], "data_offsets": [0, 32]}, {**_F32, "shape": [1], "data_offsets": [8, 12]}
            ),
            bytes(32),
        ),
        "tensors 't0' and 't1' overlap",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_is_one_unreadable_file_error_naming_the_file(case, tmp_path):
    damage, fragment = DAMAGE[case]
    path = tmp_path / "model.safetensors"
    damage(path)
    with pytest.raises(UnreadableFileError) as raised:
        read_safetensors_header(path)
    message = str(raised.value)
    assert message.startswith(f"{path} is not a readable safetensors file: "), message
    assert fragment in message and "\n" not in message and len(message) < 400, message
    assert message.endswith("restore the file or save the model again")


def test_an_error_quotes_a_long_name_shortly(tmp_path):
    name = "x\n" * 10_000
    path = _write_raw(tmp_path / "long.safetensors", {name: {**_F32, "dtype": "F7"}}, bytes(16))
    with pytest.raises(UnreadableFileError) as raised:
        read_safetensors_header(path)
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 400


# -- seeded fuzzing -----------------------------------------------------------------------------


def _outcome(path: Path, size: int) -> SafetensorsHeader | None:
    """The header read from `path`, or None when refused; any other exception, a slow call or a large
    allocation fails the test."""
    tracemalloc.reset_peak()
    before, _ = tracemalloc.get_traced_memory()
    started = time.perf_counter()
    try:
        header = read_safetensors_header(path)
    except UnreadableFileError as error:
        assert "\n" not in str(error) and str(path) in str(error)
        header = None
    assert time.perf_counter() - started < 1.0
    _, peak = tracemalloc.get_traced_memory()
    assert peak - before < size + ALLOCATION_SLACK, (peak - before, size)
    return header


def _check_consistent(header: SafetensorsHeader, content: bytes) -> None:
    """An accepted header describes byte ranges inside the file, of the right sizes, that do not overlap."""
    reach = header.data_start
    for entry in sorted(header.entries.values(), key=lambda entry: (entry.start, entry.end)):
        assert header.data_start <= entry.start <= entry.end <= len(content)
        count = 1
        for dim in entry.shape:
            count *= dim
        assert entry.nbytes * 8 == count * DTYPE_BITS[entry.dtype]
        assert entry.start >= reach or entry.nbytes == 0
        reach = max(reach, entry.end)


def _safetensors_reads(path: Path) -> bool:
    try:
        with safe_open(path, "pt") as handle:
            handle.keys()
    except Exception:  # safetensors raises its own error types, and OverflowError on a huge length
        return False
    return True


@pytest.fixture
def traced():
    tracemalloc.start()
    yield
    tracemalloc.stop()


def test_every_truncation_of_the_first_4_kib_is_refused(tmp_path, traced):
    content = _small_file(tmp_path / "small.safetensors").read_bytes()
    path = tmp_path / "cut.safetensors"
    for length in range(min(4096, len(content))):
        path.write_bytes(content[:length])
        assert _outcome(path, length) is None, length


def _overwrite_length(content: bytes, rng: random.Random) -> bytes:
    interesting = [0, 1, 2, len(content) - 9, len(content) - 8, len(content) - 7, 2**31, 2**63, 2**64 - 1]
    value = rng.choice([*interesting, rng.randrange(len(content)), rng.getrandbits(64)])
    return struct.pack("<Q", value) + content[8:]


def _overwrite_field(content: bytes, rng: random.Random) -> bytes:
    """A random 8-byte field anywhere in the file becomes a random 64-bit value."""
    offset = rng.randrange(len(content) - 8)
    return content[:offset] + struct.pack("<Q", rng.getrandbits(64)) + content[offset + 8 :]


def _overwrite_header_bytes(content: bytes, rng: random.Random) -> bytes:
    """A few header bytes become random bytes or JSON punctuation."""
    (length,) = struct.unpack("<Q", content[:8])
    edited = bytearray(content)
    for _ in range(rng.randint(1, 8)):
        offset = 8 + rng.randrange(length)
        edited[offset] = rng.choice([rng.randrange(256), *b'{}[],:"-0123456789 '])
    return bytes(edited)


def _replace_header_number(content: bytes, rng: random.Random) -> bytes:
    """One number of the header (a shape or an offset) becomes another, of any length; the length field follows."""
    (length,) = struct.unpack("<Q", content[:8])
    header, data = content[8 : 8 + length], content[8 + length :]
    numbers = list(re.finditer(rb"-?\d+", header))
    match = rng.choice(numbers)
    old = int(match.group())
    new = rng.choice([0, -1, old - 1, old + 1, old * 2, len(data), 2**64, 10**40, rng.randrange(-9, 10**6)])
    header = header[: match.start()] + str(new).encode() + header[match.end() :]
    if rng.random() < 0.5:
        header = header[: rng.randrange(len(header))] + header[rng.randrange(len(header)) :]  # and a cut
    return struct.pack("<Q", len(header)) + header + data


MUTATIONS = [_overwrite_length, _overwrite_field, _overwrite_header_bytes, _replace_header_number]


def test_seeded_mutations_read_correctly_or_are_refused(tmp_path, traced):
    content = _small_file(tmp_path / "small.safetensors").read_bytes()
    path = tmp_path / "mutated.safetensors"
    outcomes = {"refused": 0, "read": 0}
    for seed in range(400):
        rng = random.Random(seed)
        mutated = MUTATIONS[seed % len(MUTATIONS)](content, rng)
        path.write_bytes(mutated)
        header = _outcome(path, len(mutated))
        if header is None:
            assert not _safetensors_reads(path), f"seed {seed}: safetensors reads what quantlab refuses"
            outcomes["refused"] += 1
        else:
            _check_consistent(header, mutated)
            outcomes["read"] += 1
    assert outcomes["refused"] > 200 and outcomes["read"] > 10, outcomes
