"""The GGUF header check accepts what gguf-py and llama.cpp write and refuses any damage in one line, cheaply.

Real files (the tiny Llama written by gguf-py, SmolLM2 as llama.cpp converted it, a file quantlab
exports) pass and agree with gguf-py's reader (transformers' for SmolLM2: gguf-py takes seconds over
its vocabulary). Named damage cases each raise `UnreadableFileError` naming the file. A seeded fuzz
run cuts the tiny file at every offset of its first 4 KiB and overwrites its counts, lengths and
types with hostile values, and checks every outcome: a header gguf-py reads the same way, or
`UnreadableFileError`; never another exception, never a slow call, never an allocation beyond the
file's size and a small constant. A sample of the files that pass goes through `quantlab quantize`,
which must finish or fail in one line.
"""

import json
import os
import random
import shutil
import signal
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from quantlab.cli.main import main
from quantlab.errors import QuantlabError
from quantlab.files import UnreadableFileError
from quantlab.files.gguf_header import GGUFSummary, check_gguf_file
from quantlab.testing import byte_tokenizer, tiny_llama_checkpoint
from quantlab.testing.gguf_files import GGUFLayout, gguf_layout, write_tiny_gguf

gguf = pytest.importorskip("gguf")

# What a check may allocate beyond the file's size: the read buffer's bookkeeping, names, the error.
ALLOCATION_SLACK = 64 * 1024
STRING, ARRAY, UINT8, UINT32 = 8, 9, 0, 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def layout(tiny: Path) -> GGUFLayout:
    return gguf_layout(tiny)


def _agrees_with_gguf_py(summary: GGUFSummary, path: Path) -> None:
    """Counts, alignment, architecture and the start of the data are those gguf-py's reader finds."""
    reader = gguf.GGUFReader(str(path))
    assert summary.tensor_count == len(reader.tensors)
    assert summary.kv_count == len(reader.fields) - 3  # gguf-py lists the version and both counts as fields
    assert (summary.alignment, summary.data_offset) == (reader.alignment, reader.data_offset)
    architecture = reader.fields.get("general.architecture")
    if architecture is not None and architecture.types == [gguf.GGUFValueType.STRING]:
        assert summary.architecture == architecture.contents()


# -- real files ---------------------------------------------------------------------------------


def test_the_tiny_gguf_passes(tiny, layout):
    summary = check_gguf_file(tiny)
    assert summary == GGUFSummary(3, 21, 16, "llama", 32, layout.data_offset)
    _agrees_with_gguf_py(summary, tiny)


def test_the_real_smollm2_gguf_passes_in_well_under_a_second():
    from transformers.integrations.gguf.reader import GgufHeader

    from quantlab.assets.models import smollm2_gguf

    try:
        path = smollm2_gguf()
    except QuantlabError as error:
        pytest.skip(str(error))
    started = time.perf_counter()
    summary = check_gguf_file(path)
    assert time.perf_counter() - started < 0.5
    header = GgufHeader.from_file(str(path))  # transformers' reader: much faster than gguf-py's on 49k tokens
    assert (summary.version, summary.tensor_count, summary.kv_count) == (3, 272, 33)
    assert (summary.architecture, summary.data_offset) == (header.architecture, header.data_start)


def _eval(model: Path, capsys) -> dict:
    capsys.readouterr()
    assert main(["eval", str(model), "--seq-len", "64", "--windows", "2", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_gguf_quantlab_exports_from_a_tokenizer_without_merges_reads_back(tmp_path, capsys):
    """A bare byte-level tokenizer has no merges; the file still carries the (empty) merges key that
    llama.cpp requires of a "gpt2" vocabulary, so transformers does not go looking for scores."""
    folder = tiny_llama_checkpoint(tmp_path / "tiny-llama", tokenizer=byte_tokenizer(eos_and_pad=False))
    exported = tmp_path / "exported.gguf"
    assert main(["export", "gguf", str(folder), "--output", str(exported), "--quiet"]) == 0
    merges = gguf.GGUFReader(str(exported)).fields["tokenizer.ggml.merges"]
    assert merges.contents() == []
    _agrees_with_gguf_py(check_gguf_file(exported), exported)
    original, reread = _eval(folder, capsys), _eval(exported, capsys)
    assert reread["tokens"] == original["tokens"]  # the same tokenizer: the same windows of text
    assert reread["perplexity"] == pytest.approx(original["perplexity"], rel=0.01)  # Q8_0 head, F16 matrices


# -- named damage -------------------------------------------------------------------------------


def _put(offset: int, value: int, width: int = 8) -> Callable[[bytearray, GGUFLayout], None]:
    def damage(data: bytearray, layout: GGUFLayout) -> None:
        data[offset : offset + width] = value.to_bytes(width, "little")

    return damage


def _put_at(where: Callable[[GGUFLayout], int], value: int, width: int = 8) -> Callable[[bytearray, GGUFLayout], None]:
    def damage(data: bytearray, layout: GGUFLayout) -> None:
        _put(where(layout), value, width)(data, layout)

    return damage


def _cut(length: int) -> Callable[[bytearray, GGUFLayout], None]:
    def damage(data: bytearray, layout: GGUFLayout) -> None:
        del data[length:]

    return damage


def _append(extra: bytes) -> Callable[[bytearray, GGUFLayout], None]:
    return lambda data, layout: data.extend(extra)


def _rename_key(key: str, new: bytes) -> Callable[[bytearray, GGUFLayout], None]:
    """Overwrite the key's bytes in place with `new`, of the same length."""

    def damage(data: bytearray, layout: GGUFLayout) -> None:
        start = layout.entries[key].key_length + 8
        data[start : start + len(new)] = new

    return damage


Q = "blk.0.attn_q.weight"
DAMAGE = {
    "empty": (_cut(0), "the file is 0 bytes, shorter than the 24-byte header"),
    "cut at 24 bytes": (_cut(24), "need at least"),
    "cut at 100 bytes": (_cut(100), "cut short"),
    "cut in the tensor data": (_cut(200_000), "past the end of the file"),
    "bad magic": (lambda data, layout: data.__setitem__(slice(0, 4), b"GGML"), "starts with b'GGML', not b'GGUF'"),
    "version 1": (_put(4, 1, 4), "GGUF version 1"),
    "version 4": (_put(4, 4, 4), "GGUF version 4; quantlab reads versions 2 and 3"),
    "big-endian": (_put(4, 3 << 24, 4), "big-endian"),
    "tensor count 2**62": (_put(8, 2**62), "4611686018427387904 tensors"),
    "kv count 2**62": (_put(16, 2**62), "4611686018427387904 metadata entries"),
    "key length 2**60": (
        _put_at(lambda lay: lay.entries["general.architecture"].key_length, 2**60),
        "metadata key 1 of 16 is 1152921504606846976 bytes long, over the limit of 65536",
    ),
    "key not UTF-8": (_rename_key("general.name", b"\xff\xfe"), "metadata key 2 of 16 is not valid UTF-8"),
    "key twice": (_rename_key("llama.context_length", b"general.architecture"), "appears twice"),
    "string value length past the end": (
        _put_at(lambda lay: lay.entries["general.name"].value, 600_000),
        "the string value of 'general.name' needs 600000 bytes but only 531899 are left",
    ),
    "string value length 2**60": (
        _put_at(lambda lay: lay.entries["general.name"].value, 2**60),
        "the string value of 'general.name' needs 1152921504606846976 bytes",
    ),
    "array count 2**62": (
        _put_at(lambda lay: lay.entries["tokenizer.ggml.tokens"].value + 4, 2**62),
        "the array 'tokenizer.ggml.tokens' of 4611686018427387904 elements needs at least",
    ),
    "fixed-size array count 2**62": (
        _put_at(lambda lay: lay.entries["tokenizer.ggml.scores"].value + 4, 2**62),
        "the array 'tokenizer.ggml.scores' of 4611686018427387904 elements",
    ),
    "unknown value type": (
        _put_at(lambda lay: lay.entries["llama.block_count"].value_type, 13, 4),
        "the value type of 'llama.block_count' is 13, not one of GGUF's value types 0-12",
    ),
    "unknown array element type": (
        _put_at(lambda lay: lay.entries["tokenizer.ggml.tokens"].value, 99, 4),
        "the element type of the array 'tokenizer.ggml.tokens' is 99",
    ),
    "n_dims 9": (_put_at(lambda lay: lay.tensors[Q].n_dims, 9, 4), f"tensor '{Q}' has 9 dimensions, not 1 to 4"),
    "n_dims 0": (_put_at(lambda lay: lay.tensors[Q].n_dims, 0, 4), f"tensor '{Q}' has 0 dimensions"),
    "unknown ggml type": (
        _put_at(lambda lay: lay.tensors[Q].ggml_type, 99, 4),
        f"tensor '{Q}' has ggml type 99, which the gguf package does not know",
    ),
    "rows not whole blocks": (
        _put_at(lambda lay: lay.tensors["output_norm.weight"].ggml_type, int(gguf.GGMLQuantizationType.Q4_K), 4),
        "rows of 64 values, not a whole number of 256-value blocks",
    ),
    "tensor offset past the end": (
        _put_at(lambda lay: lay.tensors["output.weight"].offset, 2**40),
        "'output.weight' (64x256) ends at byte",
    ),
    "tensor offset not aligned": (
        _put_at(lambda lay: lay.tensors["output.weight"].offset, 8),
        "starts at data offset 8, not a multiple of the alignment 32",
    ),
    "tensors overlap": (
        _put_at(lambda lay: lay.tensors[Q].offset, 0),
        f"the data of tensors '{Q}' and 'token_embd.weight' overlap",
    ),
    "huge dimension": (_put_at(lambda lay: lay.tensors[Q].dims, 2**63), "past the end of the file"),
    "tensor name length 2**60": (
        _put_at(lambda lay: lay.tensors[Q].name_length, 2**60),
        "the name of tensor 2 of 21 is 1152921504606846976 bytes long",
    ),
    "tensor count too small": (_put(8, 20), "bytes past the data of its 20 tensors (a corrupt tensor count"),
    "bytes appended": (_append(bytes(100)), "the file goes on 100 bytes past the data of its 21 tensors"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_is_one_unreadable_file_error_naming_the_file(case, tiny, layout, tmp_path):
    damage, fragment = DAMAGE[case]
    data = bytearray(tiny.read_bytes())
    damage(data, layout)
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    with pytest.raises(UnreadableFileError) as raised:
        check_gguf_file(path)
    message = str(raised.value)
    assert message.startswith(f"{path} is not a readable GGUF file: "), message
    assert fragment in message and "\n" not in message and len(message) < 400, message
    assert message.endswith("; re-download it, or export it again from the original model"), message


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _metadata_only(*entries: tuple[str, int, bytes]) -> bytes:
    """A GGUF file of no tensors and the given (key, value type, value bytes) entries."""
    body = b"".join(_string(key.encode()) + struct.pack("<I", kind) + value for key, kind, value in entries)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries)) + body


def _nested(levels: int) -> bytes:
    """An array of arrays, `levels` deep, around one uint8."""
    value = struct.pack("<IQ", UINT8, 1) + b"\x07"
    for _ in range(levels - 1):
        value = struct.pack("<IQ", ARRAY, 1) + value
    return value


def test_nested_arrays_pass_to_a_bounded_depth(tmp_path):
    path = tmp_path / "nested.gguf"
    path.write_bytes(_metadata_only(("general.architecture", STRING, _string(b"llama")), ("x", ARRAY, _nested(4))))
    assert check_gguf_file(path) == GGUFSummary(3, 0, 2, "llama", 32, -(-path.stat().st_size // 32) * 32)
    path.write_bytes(_metadata_only(("x", ARRAY, _nested(5))))
    with pytest.raises(UnreadableFileError, match="nests arrays more than 4 deep"):
        check_gguf_file(path)


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_alignment_must_be_a_power_of_two(tmp_path, alignment):
    path = tmp_path / "aligned.gguf"
    path.write_bytes(_metadata_only(("general.alignment", UINT32, struct.pack("<I", alignment))))
    with pytest.raises(UnreadableFileError, match=rf"general\.alignment is {alignment}, not a power of two"):
        check_gguf_file(path)
    path.write_bytes(_metadata_only(("general.alignment", UINT8, b"\x40")))
    with pytest.raises(UnreadableFileError, match=r"general\.alignment has value type 0, not uint32"):
        check_gguf_file(path)


def test_an_error_quotes_a_long_key_shortly(tmp_path):
    path = tmp_path / "long.gguf"
    path.write_bytes(_metadata_only(("x\n" * 10_000, 13, b"")))
    with pytest.raises(UnreadableFileError) as raised:
        check_gguf_file(path)
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 400


# -- seeded fuzzing -----------------------------------------------------------------------------


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Fail the block with TimeoutError if it runs longer than `seconds` (a hang would otherwise stall the suite)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _outcome(path: Path, size: int) -> GGUFSummary | None:
    """The summary of `path`, or None when refused; any other exception, a slow call or a large allocation
    fails the test."""
    tracemalloc.reset_peak()
    before, _ = tracemalloc.get_traced_memory()
    started = time.perf_counter()
    try:
        summary = check_gguf_file(path)
    except UnreadableFileError as error:
        assert "\n" not in str(error) and str(path) in str(error)
        summary = None
    assert time.perf_counter() - started < 1.0
    _, peak = tracemalloc.get_traced_memory()
    assert peak - before < size + ALLOCATION_SLACK, (peak - before, size)
    return summary


@pytest.fixture
def traced():
    tracemalloc.start()
    yield
    tracemalloc.stop()


def test_every_cut_of_the_first_4_kib_and_a_sample_beyond_is_refused(tiny, tmp_path, traced):
    content = tiny.read_bytes()
    rng = random.Random(0)
    lengths = [*range(4096), *rng.sample(range(4096, len(content)), 60), len(content) - 1]
    path = tmp_path / "cut.gguf"
    path.write_bytes(content)
    with _deadline(20):
        for length in sorted(lengths, reverse=True):  # cut shorter and shorter: rewriting the file is slow
            os.truncate(path, length)
            assert _outcome(path, length) is None, length


# Counts and lengths a corrupt file holds: zero, small, around powers of two, far past any file.
HOSTILE = [0, 1, 2, 3, 7, 8, 31, 32, 33, 255, 256, 2**31, 2**32 - 1, 2**32, 2**60, 2**62, 2**63, 2**64 - 1]


def _hostile_u64(rng: random.Random, old: int) -> int:
    roll = rng.random()
    if roll < 0.5:
        return rng.choice(HOSTILE)
    if roll < 0.8:
        return min(max(old + rng.randint(-64, 64), 0), 2**64 - 1)
    return rng.getrandbits(64)


def _mutation(content: bytes, layout: GGUFLayout, seed: int) -> tuple[int, bytes]:
    """Where to overwrite and with what: a count or length (most seeds), a type, or any 8 header bytes."""
    rng = random.Random(seed)
    if seed % 4 == 3:
        value = rng.choice([0, 1, 4, 8, 9, 12, 13, 99, rng.getrandbits(32)])
        return rng.choice(layout.type_fields()), value.to_bytes(4, "little")
    at = rng.choice(layout.length_fields()) if seed % 4 < 2 else rng.randrange(layout.data_offset - 8)
    (old,) = struct.unpack_from("<Q", content, at)
    return at, _hostile_u64(rng, old).to_bytes(8, "little")


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(at)
        handle.write(data)


def _quantize_finishes_or_fails_in_one_line(path: Path, output: Path, capsys) -> int:
    """Exit 0, or exit 2 with one `quantlab: error:` line last on stderr (after any progress notes), no output."""
    capsys.readouterr()
    code = main(["quantize", str(path), "--method", "int8", "--output", str(output)])
    error = capsys.readouterr().err
    assert "Traceback" not in error, error
    if code != 0:
        lines = [line for line in error.splitlines() if line.strip()]
        assert code == 2 and lines and lines[-1].startswith("quantlab: error: "), (code, error)
        assert sum(line.startswith("quantlab: error:") for line in lines) == 1, error
        assert not output.exists()
    return code


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # gguf-py dequantizing garbage
def test_seeded_overwrites_pass_as_gguf_py_reads_them_or_are_refused(tiny, layout, tmp_path, traced, capsys):
    content = tiny.read_bytes()
    path = tmp_path / "mutated.gguf"
    path.write_bytes(content)
    passed = []
    with _deadline(20):
        for seed in range(400):
            at, data = _mutation(content, layout, seed)
            _overwrite(path, at, data)  # in place, and put back after: rewriting the whole file is slow
            summary = _outcome(path, len(content))
            if summary is not None:
                _agrees_with_gguf_py(summary, path)
                passed.append(seed)
            _overwrite(path, at, content[at : at + len(data)])
        assert len(passed) < 150 and len(passed) > 20, len(passed)
        tracemalloc.stop()
        codes = []
        for seed in random.Random(0).sample(passed, 15):
            mutated = shutil.copyfile(tiny, tmp_path / f"mutated-{seed}.gguf")
            _overwrite(mutated, *_mutation(content, layout, seed))
            codes.append(_quantize_finishes_or_fails_in_one_line(mutated, tmp_path / f"out-{seed}", capsys))
    assert 0 in codes and 2 in codes, codes
