"""A new storage format is one Python file: a codec and a method defined here, registered, and
nothing else edited, work through saving and reloading, the reference kernel, `quantlab inspect`,
ONNX export, LoRA training and sparse storage.

The toy format: 4-bit codes indexing a 16-entry level table per layer (15 quantiles of the layer's
non-zero weights, and zero), stored as a tensor beside the packed codes. It has no
per-group grid, no native kernel and no ONNX lowering of its own.
"""

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import quantlab
from quantlab import registry
from quantlab.config import QuantlabConfig
from quantlab.formats import codec as codec_registry
from quantlab.formats import grouping, packing
from quantlab.formats.codec import Codec, TensorSpec, register_codec
from quantlab.formats.layout import StorageLayout
from quantlab.nn import QuantizedLinear
from quantlab.testing import tiny_llama
from quantlab.testing.lora import lora_step

LEVELS = 16
BITS = 4
IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))


class ToyTableCodec(Codec):
    """Codes `[out, 1, bytes]` packed 4 to the nibble, and `weight_levels` `[16]`: `w ≈ levels[q]`."""

    name = "toy_table"

    def tensors(self, layout: StorageLayout) -> dict[str, TensorSpec]:
        code_bytes = packing.packed_size(layout.group_length, BITS)
        return {
            "weight": TensorSpec((layout.out_features, layout.groups, code_bytes), torch.uint8),
            "weight_levels": TensorSpec((LEVELS,), torch.float32),
        }

    def quantize(self, layout: StorageLayout, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        weight = weight.float()
        nonzero = weight[weight != 0]
        quantiles = torch.quantile(nonzero, (torch.arange(LEVELS - 1) + 0.5) / (LEVELS - 1))
        table = torch.cat([quantiles, torch.zeros(1)]).sort().values  # zero is a level: pruned weights stay zero
        grouped = grouping.group(weight, layout.group_size)
        codes = torch.bucketize(grouped, (table[1:] + table[:-1]) / 2).to(torch.uint8)
        return {"weight": packing.pack(codes, BITS), "weight_levels": table}

    def dequantize(
        self, layout: StorageLayout, stored: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        codes = packing.unpack(stored["weight"], BITS, layout.group_length)
        return grouping.ungroup(stored["weight_levels"][codes.long()], layout.in_features).to(dtype)


@dataclasses.dataclass(repr=False)
class ToyTableConfig(QuantlabConfig):
    """A 16-level table per layer (test only)."""

    method = "toy_table"


class ToyTableLinear(QuantizedLinear):
    config_class = ToyTableConfig

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: ToyTableConfig) -> StorageLayout:
        return StorageLayout(ToyTableCodec.name, BITS, None, in_features, out_features)


def register_toy() -> None:
    """What a plugin's entry point would run."""
    register_codec(ToyTableCodec())
    registry.register_method(ToyTableConfig, ToyTableLinear, source="test")


@pytest.fixture(scope="module")
def toy():
    """The toy codec and method registered for this module's tests only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec_registry, "_CODECS", dict(codec_registry._CODECS))
        patch.setattr(registry, "_METHODS", dict(registry._METHODS))
        register_toy()
        yield


@pytest.fixture(scope="module")
def quantized(toy):
    return quantlab.quantize(tiny_llama(seed=4), ToyTableConfig())


@pytest.fixture(scope="module")
def saved(quantized, tmp_path_factory):
    directory = tmp_path_factory.mktemp("toy") / "model"
    quantized.save_pretrained(directory)
    return directory


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_every_projection_stores_the_toy_format(quantized):
    layers = [module for module in quantized.modules() if isinstance(module, QuantizedLinear)]
    assert len(layers) == 14
    for layer in layers:
        assert layer.layout.codec_object.name == "toy_table"
        assert set(layer.stored_tensors()) == {"weight", "weight_levels"}


def test_the_reference_kernel_computes_x_times_the_dequantized_weight(quantized):
    layer = quantized.model.layers[0].mlp.up_proj
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x @ layer.dequantize_weight().T, rtol=0, atol=1e-6)


def test_a_fresh_process_reloads_identical_tensors_and_logits(quantized, saved, tmp_path):
    result = tmp_path / "reloaded.pt"
    child = textwrap.dedent(f"""
        import importlib.util, torch, quantlab
        spec = importlib.util.spec_from_file_location("toy_codec", {str(Path(__file__))!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.register_toy()
        model = quantlab.load({str(saved)!r})
        with torch.no_grad():
            logits = model(module.IDS).logits
        torch.save({{"state": model.state_dict(), "logits": logits}}, {str(result)!r})
    """)
    subprocess.run([sys.executable, "-c", child], check=True, timeout=600)
    reloaded = torch.load(result)
    state = quantized.state_dict()
    assert reloaded["state"].keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(reloaded["state"][name], tensor), name
    assert torch.equal(reloaded["logits"], _logits(quantized))


def test_inspect_prints_the_toy_layers(saved, capsys):
    from quantlab.cli.main import main

    assert main(["inspect", str(saved)]) == 0
    output = capsys.readouterr().out
    assert "toy_table" in output
    assert "14 of 15 Linear layers quantized" in output  # the output head stays float


def test_onnx_export_takes_the_fallback_and_matches_torch(quantized, tmp_path):
    pytest.importorskip("onnxruntime", reason="needs quantlab[onnx]")
    from quantlab.export import OnnxCausalLM, to_onnx

    result = to_onnx(quantized, tmp_path / "toy.onnx")
    assert set(result.layer_operators.values()) == {"fallback"}
    mask = torch.ones_like(IDS)
    onnx_logits = OnnxCausalLM(tmp_path / "toy.onnx")(IDS, mask)
    np.testing.assert_allclose(onnx_logits.numpy(), _logits(quantized).numpy(), rtol=1e-4, atol=1e-4)


def test_a_lora_step_changes_only_the_adapters(toy):
    kept, changed = lora_step(quantlab.quantize(tiny_llama(seed=5), ToyTableConfig()), IDS)
    assert kept and changed and all("lora_" in name for name in changed)


def test_a_pruned_then_quantized_model_is_stored_sparse_and_reloads_bit_identically(toy, tmp_path):
    from quantlab.prune import load_sparse, make_permanent, prune, save_sparse, sparse_storage

    model = tiny_llama(seed=6)
    prune(model, "2:4")
    make_permanent(model)
    quantlab.quantize(model, ToyTableConfig())
    save_sparse(model, tmp_path / "sparse")
    storage = sparse_storage(tmp_path / "sparse")
    assert {entry.kind for entry in storage.tensors.values()} == {"quantized"}
    reloaded = load_sparse(tmp_path / "sparse")
    state, again = model.state_dict(), reloaded.state_dict()
    assert state.keys() == again.keys()
    for name, tensor in state.items():
        assert torch.equal(again[name], tensor), name
    weight = reloaded.model.layers[0].mlp.up_proj.dequantize_weight()
    assert float((weight == 0).float().mean()) >= 0.5
