"""Large models keep their weights in `<file>.data` (protobuf stops at 2 GiB); writes are atomic."""

import numpy as np
import onnxruntime as ort
import torch

import quantlab
from quantlab.export import to_onnx
from quantlab.export.onnx import saving
from quantlab.testing import tiny_bert


def _last_hidden_state(path, ids: torch.Tensor) -> np.ndarray:
    feed = {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy())}
    feed["token_type_ids"] = np.zeros_like(feed["input_ids"])
    return ort.InferenceSession(path).run(["last_hidden_state"], feed)[0]


def test_weights_above_the_threshold_go_to_a_side_file(onnx_path, monkeypatch) -> None:
    model = quantlab.quantize(tiny_bert(), quantlab.CustomBitsConfig(bits=4))
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(saving, "EXTERNAL_DATA_THRESHOLD", 10_000)
    result = to_onnx(model, onnx_path)
    data = onnx_path.parent / (onnx_path.name + ".data")
    assert data.is_file() and data.stat().st_size > onnx_path.stat().st_size
    assert result.bytes == onnx_path.stat().st_size + data.stat().st_size
    assert sorted(p.name for p in onnx_path.parent.iterdir()) == sorted([onnx_path.name, data.name])
    external = _last_hidden_state(onnx_path, ids)

    monkeypatch.setattr(saving, "EXTERNAL_DATA_THRESHOLD", 1 << 40)
    to_onnx(model, onnx_path, overwrite=True)
    assert not data.exists()  # no stale side file next to a self-contained export
    assert np.array_equal(_last_hidden_state(onnx_path, ids), external)
