"""Bad input ends in an `ExportError` naming the model or module, never an exporter traceback."""

import pytest
import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

import quantlab
from quantlab.errors import QuantlabError
from quantlab.export import ExportError, to_onnx
from quantlab.nn import QuantizedLinear
from quantlab.testing import tiny_bert, tiny_llama
from quantlab.utils.atomic import OutputExistsError


class _DataDependentBranch(nn.Module):
    """Python control flow on tensor values: torch.export cannot trace it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) if x.sum() > 0 else -self.inner(x)


class _NoOnnxOperator(nn.Module):
    """An operator with no ONNX translation (Hurwitz zeta)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        y = self.inner(x)
        return y + torch.special.zeta(torch.full_like(y, 2.0), torch.ones_like(y))


class _PluginLinear(QuantizedLinear):
    """A quantized layer of a plugin that registered no ONNX lowering."""

    config_class = quantlab.Int8SymmetricConfig

    @property
    def format(self) -> str:
        return "plugin"

    @classmethod
    def storage_spec(cls, in_features, out_features, config):
        return {"weight": ((out_features, 1, in_features), torch.int8)}

    @classmethod
    def quantize_weight(cls, weight, config):
        return {"weight": weight.sign().to(torch.int8).unsqueeze(1)}

    def dequantize_weight(self, dtype=torch.float32):
        return self.weight.squeeze(1).to(dtype)


class _ForeignInt8Linear(nn.Module):
    """Another library's quantized layer: integer weight, not a quantlab layer."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().sign().to(torch.int8))

    def forward(self, x):
        return x @ self.weight.t().to(x.dtype)


def _llama_with(module_class: type, layer: str = "mlp") -> nn.Module:
    model = tiny_llama()
    block = model.model.layers[0]
    setattr(block, layer, module_class(getattr(block, layer)))
    return model


def test_export_error_is_a_quantlab_error() -> None:
    assert issubclass(ExportError, QuantlabError)


def test_untraceable_module_is_named(onnx_path) -> None:
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.mlp \(_DataDependentBranch\) cannot be exported"):
        to_onnx(_llama_with(_DataDependentBranch), onnx_path)
    assert not onnx_path.exists()


def test_operator_without_onnx_translation_is_named_and_the_previous_file_kept(onnx_path) -> None:
    onnx_path.write_bytes(b"previous export")
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.mlp \(_NoOnnxOperator\) cannot be converted.*zeta"):
        to_onnx(_llama_with(_NoOnnxOperator), onnx_path, overwrite=True)
    assert onnx_path.read_bytes() == b"previous export"
    assert sorted(p.name for p in onnx_path.parent.iterdir()) == [onnx_path.name]


def test_quantized_layer_without_lowering_is_named(onnx_path) -> None:
    model = tiny_llama()
    up = model.model.layers[1].mlp.up_proj
    model.model.layers[1].mlp.up_proj = _PluginLinear.from_linear(up, quantlab.Int8SymmetricConfig())
    with pytest.raises(ExportError, match=r"^model\.layers\.1\.mlp\.up_proj: no ONNX lowering for .*_PluginLinear"):
        to_onnx(model, onnx_path)


def test_foreign_quantized_layer_is_named(onnx_path) -> None:
    model = tiny_llama()
    model.model.layers[0].self_attn.q_proj = _ForeignInt8Linear(model.model.layers[0].self_attn.q_proj)
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.self_attn\.q_proj: _ForeignInt8Linear stores .*int8"):
        to_onnx(model, onnx_path)


def test_encoder_decoder_is_refused(onnx_path) -> None:
    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    with pytest.raises(ExportError, match="T5ForConditionalGeneration: encoder-decoder models are not supported"):
        to_onnx(T5ForConditionalGeneration(config), onnx_path)


def test_plain_module_is_refused(onnx_path) -> None:
    with pytest.raises(ExportError, match="Sequential is not a transformers PreTrainedModel"):
        to_onnx(nn.Sequential(nn.Linear(4, 4)), onnx_path)


def test_past_key_values_of_an_encoder_are_refused(onnx_path) -> None:
    with pytest.raises(ExportError, match="BertModel is an encoder: with_past only applies to causal LMs"):
        to_onnx(tiny_bert(), onnx_path, with_past=True)


def test_dynamic_int8_of_a_quantized_model_is_refused(onnx_path) -> None:
    model = quantlab.quantize(tiny_llama(), quantlab.NF4Config())
    with pytest.raises(
        ExportError, match=r"^model\.layers\.0\.self_attn\.q_proj: ort_dynamic_int8 .* already quantized"
    ):
        to_onnx(model, onnx_path, ort_dynamic_int8=True)


def test_existing_output_is_kept_unless_overwrite(onnx_path) -> None:
    onnx_path.write_bytes(b"previous export")
    with pytest.raises(OutputExistsError, match="already exists"):
        to_onnx(tiny_bert(), onnx_path)
    assert onnx_path.read_bytes() == b"previous export"
    to_onnx(tiny_bert(), onnx_path, overwrite=True)
    assert onnx_path.stat().st_size > 1000
    assert sorted(p.name for p in onnx_path.parent.iterdir()) == [onnx_path.name]
