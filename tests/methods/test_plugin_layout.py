"""A plugin layer that declares a built-in codec's storage layout and nothing else gets the native
CPU kernels, an ONNX lowering and sparse storage: each reads `layer.layout`, never the class."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from quantlab import CustomBitsConfig
from quantlab.formats import grouping
from quantlab.formats.layout import StorageLayout
from quantlab.kernels import select_kernel
from quantlab.kernels.cpu import native
from quantlab.kernels.cpu.linear import native_dequantize, native_linear
from quantlab.kernels.cpu.weights import native_weight
from quantlab.kernels.reference import dequantize_matmul
from quantlab.nn import QuantizedLinear
from quantlab.prune.codes import CodeLayout, code_layout
from quantlab.prune.storage import (
    FORMAT_VERSION,
    METADATA_KEY,
    SPARSE_WEIGHTS_FILE,
    encode_state_dict,
    read_sparse_state_dict,
)


class ClippedLinear(QuantizedLinear):
    """A plugin's method: symmetric affine codes whose scale clips each group at 2.5 standard
    deviations instead of its absmax. It declares its layout and its own rounding, nothing more."""

    config_class = CustomBitsConfig

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: CustomBitsConfig) -> StorageLayout:
        return StorageLayout(
            "affine", config.bits, config.group_size, in_features, out_features, scale_dtype=torch.float16
        )

    @classmethod
    def quantize_weight(cls, weight: torch.Tensor, config: CustomBitsConfig) -> dict[str, torch.Tensor]:
        layout = cls.layout_for(weight.shape[1], weight.shape[0], config)
        grouped = grouping.group(weight.float(), layout.group_size)
        steps = max(1, (1 << (layout.bits - 1)) - 1)
        params = layout.grid(2.5 * grouped.std(dim=-1) / steps)
        return layout.store(layout.quantize_grouped(grouped, params), params)


class OneBitLinear(ClippedLinear):
    """The same rounding on a 1-bit layout, narrower than the native kernels decode."""

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: CustomBitsConfig) -> StorageLayout:
        return StorageLayout("affine", 1, config.group_size, in_features, out_features, scale_dtype=torch.float16)


def plugin_layer(bits: int = 4, in_features: int = 96, out_features: int = 24, layer_class=ClippedLinear):
    torch.manual_seed(bits)
    linear = nn.Linear(in_features, out_features)
    return layer_class.from_linear(linear, CustomBitsConfig(bits=bits, group_size=32, symmetric=True))


@pytest.mark.parametrize("bits", [3, 4])
def test_plugin_layout_runs_on_the_native_kernels(bits):
    layer = plugin_layer(bits)
    assert layer.format == "affine"
    assert select_kernel(layer.format, "cpu") is native_linear
    x = torch.randn(5, 96)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), dequantize_matmul(layer, x), rtol=0, atol=1e-5)
    if native.library() is not None:
        assert torch.equal(native_dequantize(native_weight(layer)), layer.dequantize_weight())


def test_layout_the_native_kernels_cannot_decode_runs_on_the_reference():
    layer = plugin_layer(layer_class=OneBitLinear)
    x = torch.randn(3, 96)
    with torch.no_grad():
        assert torch.equal(native_linear(layer, x), dequantize_matmul(layer, x))


@pytest.mark.parametrize(("bits", "operator"), [(4, "MatMulNBits"), (3, "fallback")])
def test_plugin_layout_exports_to_onnx(bits, operator):
    ort = pytest.importorskip("onnxruntime", reason="needs quantlab[onnx]")
    import onnx_ir as ir

    from quantlab.export.onnx.lower_graph import lowering_for
    from quantlab.export.onnx.lowering import LayerLowering

    layer = plugin_layer(bits)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["rows", layer.in_features]))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 20, "com.microsoft": 1})
    ctx = LayerLowering(name="layer", x=x, graph=graph, created={})
    y = lowering_for("layer", layer)(ctx, layer)
    assert ctx.operator == operator
    y.dtype, y.shape = ir.DataType.FLOAT, ir.Shape(["rows", layer.out_features])
    graph.extend(ctx.tape.nodes)
    graph.outputs.append(y)
    session = ort.InferenceSession(ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString())
    inputs = torch.randn(4, layer.in_features)
    (result,) = session.run(None, {"x": inputs.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(result, dequantize_matmul(layer, inputs).numpy(), rtol=1e-4, atol=1e-5)


def test_plugin_layout_is_stored_sparse_and_reloads_bit_identically(tmp_path):
    linear = nn.Linear(128, 32)
    with torch.no_grad():
        linear.weight[:, ::2] = 0  # half pruned: symmetric codes hold zero exactly
    layer = ClippedLinear.from_linear(linear, CustomBitsConfig(bits=3, group_size=32, symmetric=True))
    assert code_layout(layer) == CodeLayout("packed", 3, 32)
    tensors = {f"layer.{name}": tensor for name, tensor in layer.stored_tensors().items()}
    stored, entries = encode_state_dict(tensors, {"layer": layer})
    assert entries["layer.weight"]["encoding"] == "codes"
    assert sum(t.numel() * t.element_size() for t in stored.values()) < sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    metadata = {"format": "pt", METADATA_KEY: json.dumps({"format_version": FORMAT_VERSION, "tensors": entries})}
    save_file(stored, str(tmp_path / SPARSE_WEIGHTS_FILE), metadata=metadata)
    state_dict, _ = read_sparse_state_dict(tmp_path)
    assert state_dict.keys() == tensors.keys()
    assert all(torch.equal(state_dict[name], tensors[name]) for name in tensors)
