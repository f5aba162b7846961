"""The streamed writer produces safetensors' own bytes; the reader reads any tensor alone, converted on request."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantlab.streaming.reader import CheckpointReader, NotStreamableError
from quantlab.streaming.writer import SafetensorsWriter, shard_plan

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool]


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for index, dtype in enumerate(DTYPES):
        values = torch.randn(3, 5 + index, generator=generator) * 50
        tensors[f"layer.{index}.w"] = values > 0 if dtype == torch.bool else values.to(dtype)
    tensors["scalar"] = torch.tensor(2.5)
    return tensors


def _write(folder, tensors, max_shard_bytes=10**9, order=None):
    layout = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    headers, slots = shard_plan(layout, {"format": "pt"}, max_shard_bytes)
    writer = SafetensorsWriter(folder, headers, slots)
    writer.create()
    for name in order or reversed(list(tensors)):  # any order: each tensor has its place
        writer.write(name, tensors[name])
    writer.write_index(total_parameters=123)
    writer.close()
    return writer


def test_a_single_file_is_byte_for_byte_what_safetensors_writes(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "expected.safetensors", metadata={"format": "pt"})
    _write(tmp_path, tensors)
    assert (tmp_path / "model.safetensors").read_bytes() == (tmp_path / "expected.safetensors").read_bytes()


def test_shards_and_index_reload_every_tensor(tmp_path):
    tensors = _tensors()
    _write(tmp_path, tensors, max_shard_bytes=64)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_parameters": 123, "total_size": sum(t.nbytes for t in tensors.values())}
    loaded = {}
    for file in set(index["weight_map"].values()):
        loaded.update(load_file(tmp_path / file))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)


def test_the_reader_reads_each_tensor_alone_and_converts(tmp_path):
    tensors = _tensors()
    _write(tmp_path, tensors, max_shard_bytes=64)
    with CheckpointReader(tmp_path) as reader:
        assert sorted(reader.names()) == sorted(tensors)
        assert torch.equal(reader.tensor("layer.1.w"), tensors["layer.1.w"])
        converted = reader.tensor("layer.1.w", torch.float32)  # bf16 -> fp32 as from_pretrained converts
        assert converted.dtype == torch.float32 and torch.equal(converted, tensors["layer.1.w"].float())
        assert torch.equal(reader.tensor("scalar"), tensors["scalar"])


def test_a_writer_refuses_a_tensor_that_does_not_fit_its_slot(tmp_path):
    tensors = _tensors()
    writer = _write(tmp_path, tensors)
    with pytest.raises(ValueError, match="its slot"):
        writer.write("layer.0.w", torch.zeros(2, 2))


def test_a_folder_without_safetensors_is_not_streamable(tmp_path):
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(NotStreamableError, match=r"holds no model\.safetensors"):
        CheckpointReader(tmp_path)
