"""A shard index naming a file outside its model folder is refused before anything reads it.

The model is a tiny Llama saved in shards; its last shard is moved to `../victim/model.safetensors`
(a real safetensors file with the tensors the index expects) and the index is edited to name it
there, relatively or absolutely. `quantlab quantize` (streamed) and `quantlab eval` (through
transformers) would both have followed it; each must exit 2 with one line naming the index and
the entry, write nothing, and leave the victim as it was.
"""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from quantlab.cli.main import main
from quantlab.files.shard_index import INDEX_FILE
from quantlab.testing import byte_tokenizer, tiny_llama

VICTIM = "../victim/model.safetensors"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama and its tokenizer, saved in shards of at most 100 KB."""
    folder = tmp_path_factory.mktemp("sharded") / "model"
    tiny_llama().save_pretrained(folder, max_shard_size="100KB")
    byte_tokenizer().save_pretrained(folder)
    return folder


def _moved_out(sharded: Path, tmp_path: Path, name: Callable[[Path], str]) -> Path:
    """A copy of `sharded` whose last shard lives at `../victim/model.safetensors`, named by `name(victim)`."""
    folder = shutil.copytree(sharded, tmp_path / "model")
    index = json.loads((folder / INDEX_FILE).read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    victim = tmp_path / "victim" / "model.safetensors"
    victim.parent.mkdir()
    (folder / last).rename(victim)
    index["weight_map"] = {k: name(victim) if v == last else v for k, v in index["weight_map"].items()}
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return folder


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()
    }


COMMANDS = {
    "quantize": lambda model, tmp: ["quantize", model, "--method", "int8", "-o", tmp / "out"],
    "eval": lambda model, tmp: ["eval", model, "--seq-len", "64", "--windows", "2"],
}
NAMES = {"relative": lambda victim: VICTIM, "absolute": lambda victim: str(victim)}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("how", list(NAMES))
def test_an_index_naming_a_shard_outside_is_refused(command, how, sharded, tmp_path, capsys):
    folder = _moved_out(sharded, tmp_path, NAMES[how])
    named = NAMES[how](tmp_path / "victim" / "model.safetensors")
    before = _snapshot(tmp_path)
    capsys.readouterr()
    assert main([str(arg) for arg in COMMANDS[command](folder, tmp_path)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("quantlab: error: "), err
    assert "Traceback" not in err
    assert str(folder / INDEX_FILE) in lines[0] and f"names shard '{named}'" in lines[0], lines[0]
    assert _snapshot(tmp_path) == before  # nothing written, the victim untouched
    assert not (tmp_path / "out").exists()


def test_the_same_shards_inside_the_folder_quantize(sharded, tmp_path, capsys):
    """The setup is sound: with the moved shard back inside and named there, the model quantizes."""
    folder = _moved_out(sharded, tmp_path, lambda victim: "moved/model.safetensors")
    (tmp_path / "victim").rename(folder / "moved")
    assert main(["quantize", str(folder), "--method", "int8", "-o", str(tmp_path / "out")]) == 0, capsys.readouterr()
    assert (tmp_path / "out" / "config.json").is_file()
