"""A damaged GGUF file given as MODEL is refused in one line naming the file: exit 2, no traceback, nothing written.

Each case damages the tiny Llama's GGUF file the way a cut download or a corrupt disk would: cut
short, a count or length far past the file, a key that is not UTF-8 (which transformers reported
as a config file that "is not a valid JSON file"). The commands run in this process
(`quantlab.cli.main.main`), as the console script would.
"""

from collections.abc import Callable
from pathlib import Path

import pytest

from quantlab.cli.main import main
from quantlab.testing.gguf_files import GGUFLayout, gguf_layout, write_tiny_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _cut(length: int) -> Callable[[bytearray, GGUFLayout], None]:
    def damage(data: bytearray, layout: GGUFLayout) -> None:
        del data[length:]

    return damage


def _put(where: Callable[[GGUFLayout], int], value: int, width: int = 8) -> Callable[[bytearray, GGUFLayout], None]:
    def damage(data: bytearray, layout: GGUFLayout) -> None:
        at = where(layout)
        data[at : at + width] = value.to_bytes(width, "little")

    return damage


def _key_not_utf8(data: bytearray, layout: GGUFLayout) -> None:
    at = layout.entries["general.name"].key_length + 8
    data[at : at + 2] = b"\xff\xfe"


CASES = {
    "cut to 24 bytes": _cut(24),
    "cut to 100 bytes": _cut(100),
    "cut in the tensor data": _cut(300_000),
    "tensor count 2**62": _put(lambda layout: layout.tensor_count, 2**62),
    "metadata count 2**62": _put(lambda layout: layout.kv_count, 2**62),
    "key length 2**60": _put(lambda layout: layout.entries["general.architecture"].key_length, 2**60),
    "token count 2**62": _put(lambda layout: layout.entries["tokenizer.ggml.tokens"].value + 4, 2**62),
    "key not UTF-8": _key_not_utf8,
}


def _damaged(tiny_gguf: Path, folder: Path, damage: Callable[[bytearray, GGUFLayout], None]) -> Path:
    data = bytearray(tiny_gguf.read_bytes())
    damage(data, gguf_layout(tiny_gguf))
    path = folder / "model.gguf"
    path.write_bytes(data)
    return path


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def _assert_one_line_naming(path: Path, argv: list[str], capsys) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error, error
    lines = [line for line in error.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"quantlab: error: {path} is not a readable GGUF file: "), lines


@pytest.mark.parametrize("case", list(CASES))
def test_quantize_refuses_a_damaged_gguf_in_one_line(case, tiny_gguf, tmp_path, capsys):
    path = _damaged(tiny_gguf, tmp_path, CASES[case])
    before = _snapshot(tmp_path)
    _assert_one_line_naming(path, ["quantize", str(path), "--method", "int8", "-o", str(tmp_path / "out")], capsys)
    assert _snapshot(tmp_path) == before  # no output, no staging folder, no converted copy left behind


def test_eval_refuses_a_damaged_gguf_in_one_line(tiny_gguf, tmp_path, capsys):
    path = _damaged(tiny_gguf, tmp_path, CASES["cut to 100 bytes"])
    _assert_one_line_naming(path, ["eval", str(path), "--seq-len", "64", "--windows", "2"], capsys)


def test_a_gguf_whose_tensor_name_is_damaged_is_refused_not_filled_with_random_weights(tiny_gguf, tmp_path, capsys):
    """The header is sound, but a weight the architecture needs is missing: transformers would fill it at random."""

    def rename(data: bytearray, layout: GGUFLayout) -> None:
        tensor = layout.tensors["blk.0.attn_q.weight"]
        end = tensor.name_length + 8 + len("blk.0.attn_q.weight")
        data[end - 1 : end] = b"X"

    path = _damaged(tiny_gguf, tmp_path, rename)
    before = _snapshot(tmp_path)
    capsys.readouterr()
    assert main(["quantize", str(path), "--method", "int8", "-o", str(tmp_path / "out"), "--quiet"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[-1].startswith(f"quantlab: error: {path} lacks the weights model.layers.0.self_attn.q_proj.weight")
    assert sum(line.startswith("quantlab: error:") for line in lines) == 1 and _snapshot(tmp_path) == before
