"""A shard index names files inside its model folder, or it is refused in one line naming the index and the entry.

Each case writes a `model.safetensors.index.json` beside two real shards (and a victim file
outside the folder, which a bad entry may point at) and expects `UnreadableFileError`.
`check_weight_files` applies the same rules and the header checks to a whole folder.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantlab.files import UnreadableFileError
from quantlab.files.shard_index import INDEX_FILE, check_weight_files, read_shard_index
from quantlab.testing import tiny_llama

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A model folder with two shards and an index naming them; `../victim/model.safetensors` exists too."""
    model = tmp_path / "model"
    model.mkdir()
    save_file({"a": torch.ones(4)}, model / SHARDS[0])
    save_file({"b": torch.ones(4)}, model / SHARDS[1])
    (tmp_path / "victim").mkdir()
    save_file({"b": torch.zeros(4)}, tmp_path / "victim" / "model.safetensors")
    _write_index(model, {"a": SHARDS[0], "b": SHARDS[1]})
    return model


def _write_index(folder: Path, weight_map: object, text: str | None = None) -> Path:
    index = folder / INDEX_FILE
    index.write_text(text if text is not None else json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def _refused(index: Path, *fragments: str) -> str:
    with pytest.raises(UnreadableFileError) as raised:
        read_shard_index(index)
    message = str(raised.value)
    assert message.startswith(str(index)) and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def test_an_index_reads_to_its_sorted_shards(folder):
    index = read_shard_index(folder / INDEX_FILE)
    assert index.shards == [folder / SHARDS[0], folder / SHARDS[1]]
    assert index.weight_map == {"a": SHARDS[0], "b": SHARDS[1]}


def test_an_index_saved_by_transformers_reads(tmp_path):
    tiny_llama().save_pretrained(tmp_path, max_shard_size="100KB")
    index = read_shard_index(tmp_path / INDEX_FILE)
    assert len(index.shards) > 2 and check_weight_files(tmp_path) == index.shards


def test_a_shard_in_a_subfolder_or_linked_inside_is_accepted(folder):
    (folder / "parts").mkdir()
    (folder / SHARDS[1]).rename(folder / "parts" / SHARDS[1])
    (folder / "linked.safetensors").symlink_to(folder / "parts" / SHARDS[1])
    _write_index(folder, {"a": f"parts/{SHARDS[1]}", "b": "linked.safetensors"})
    assert read_shard_index(folder / INDEX_FILE).shards == [folder / "linked.safetensors", folder / "parts" / SHARDS[1]]


def test_a_hub_cache_snapshot_may_link_into_its_blobs(tmp_path):
    repository = tmp_path / "models--org--name"
    snapshot, blobs = repository / "snapshots" / "0123abc", repository / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    save_file({"a": torch.ones(4)}, blobs / "5f2e")
    (snapshot / SHARDS[0]).symlink_to("../../blobs/5f2e")
    _write_index(snapshot, {"a": SHARDS[0]})
    assert check_weight_files(snapshot) == [snapshot / SHARDS[0]]


def test_a_parent_escape_is_refused(folder):
    index = _write_index(folder, {"a": SHARDS[0], "b": "../victim/model.safetensors"})
    _refused(index, "names shard '../victim/model.safetensors', which lies outside the model folder")


def test_an_escape_through_a_subfolder_is_refused(folder):
    (folder / "parts").mkdir()
    index = _write_index(folder, {"a": SHARDS[0], "b": "parts/../../victim/model.safetensors"})
    _refused(index, "'parts/../../victim/model.safetensors', which lies outside the model folder")


def test_an_absolute_path_is_refused(folder):
    victim = folder.parent / "victim" / "model.safetensors"
    index = _write_index(folder, {"a": SHARDS[0], "b": str(victim)})
    _refused(index, f"names shard '{victim}', an absolute path")


def test_a_windows_absolute_path_is_refused(folder):
    _refused(_write_index(folder, {"a": "C:\\models\\victim.safetensors"}), "an absolute path")


def test_a_shard_linked_outside_is_refused(folder):
    (folder / SHARDS[1]).unlink()
    (folder / SHARDS[1]).symlink_to(folder.parent / "victim" / "model.safetensors")
    message = _refused(folder / INDEX_FILE, f"names shard '{SHARDS[1]}', which lies outside the model folder")
    assert str(folder.parent / "victim" / "model.safetensors") in message


def test_a_folder_linked_outside_is_refused(folder):
    (folder / "parts").symlink_to(folder.parent / "victim")
    index = _write_index(folder, {"a": SHARDS[0], "b": "parts/model.safetensors"})
    _refused(index, "'parts/model.safetensors', which lies outside the model folder")


def test_a_symlink_loop_is_refused(folder):
    (folder / "loop.safetensors").symlink_to(folder / "loop.safetensors")
    _refused(_write_index(folder, {"a": "loop.safetensors"}), "'loop.safetensors'")


def test_a_missing_shard_is_refused(folder):
    (folder / SHARDS[1]).unlink()
    _refused(folder / INDEX_FILE, f"names shard '{SHARDS[1]}', which is missing from {folder}")


def test_a_folder_named_as_a_shard_is_refused(folder):
    (folder / "parts").mkdir()
    _refused(_write_index(folder, {"a": "parts"}), "names shard 'parts', which is missing")


@pytest.mark.parametrize(
    ("weight_map", "text", "fragment"),
    [
        (["a", SHARDS[0]], None, "its weight_map is a JSON list, not an object"),
        (None, json.dumps({"metadata": {}}), "its weight_map is none"),
        ({}, None, "names no shard"),
        ({"a": 3}, None, "maps 'a' to 3, not a file name"),
        ({"a": ""}, None, "maps 'a' to '', not a file name"),
        ({"a": "x\0y"}, None, "an absolute path"),
        (None, "{weight_map: ", "is not a shard index: not JSON"),
        (None, "[]", "a JSON list, not an object"),
        (None, "[" * 100_000, "not JSON"),
    ],
    ids=["list", "absent", "empty", "number", "empty name", "NUL", "not JSON", "JSON list", "deep nesting"],
)
def test_a_malformed_index_is_refused(folder, weight_map, text, fragment):
    _refused(_write_index(folder, weight_map, text), fragment, "restore the index or save the model again")


def test_check_weight_files_checks_every_shard_header(folder):
    assert check_weight_files(folder) == [folder / SHARDS[0], folder / SHARDS[1]]
    (folder / SHARDS[1]).write_bytes((folder / SHARDS[1]).read_bytes()[:-2])
    with pytest.raises(UnreadableFileError, match=re.escape(f"{SHARDS[1]} is not a readable safetensors file")):
        check_weight_files(folder)


def test_check_weight_files_checks_a_single_file_and_other_safetensors(tmp_path):
    save_file({"a": torch.ones(4)}, tmp_path / "model.safetensors")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(UnreadableFileError, match=re.escape("adapter_model.safetensors is not a readable")):
        check_weight_files(tmp_path)
    (tmp_path / "adapter_model.safetensors").unlink()
    assert check_weight_files(tmp_path) == [tmp_path / "model.safetensors"]


def test_check_weight_files_refuses_an_escaping_index(folder):
    _write_index(folder, {"a": SHARDS[0], "b": "../victim/model.safetensors"})
    with pytest.raises(UnreadableFileError, match="lies outside the model folder"):
        check_weight_files(folder)


def test_check_weight_files_refuses_an_escaping_bin_index(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    index = _write_index(tmp_path / "model", {"a": "../pytorch_model.bin"})
    index.rename(tmp_path / "model" / "pytorch_model.bin.index.json")
    with pytest.raises(UnreadableFileError, match=r"pytorch_model\.bin\.index\.json names shard '\.\./pytorch_model"):
        check_weight_files(tmp_path / "model")
