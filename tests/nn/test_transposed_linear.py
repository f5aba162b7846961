"""GPT-2's `Conv1D` (`x W + b`, weight `[in, out]`) is quantized as the Linear layer of its transposed weight."""

import warnings

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import quantlab
from quantlab.methods.custom_bits import CustomBitsConfig, CustomBitsLinear
from quantlab.nn.kinds import as_linear, is_quantizable_linear, register_linear_kind
from quantlab.plan import build_plan
from quantlab.replacement import quantized_layers
from quantlab.testing.architectures import tiny_causal_lm

RTN = {"bits": 4, "group_size": 32}
CONFIG = CustomBitsConfig(**RTN)


def _linear_of(conv: Conv1D) -> nn.Linear:
    """A separate `nn.Linear` computing what `conv` computes, its weight contiguous."""
    linear = nn.Linear(conv.nx, conv.nf)
    linear.weight.data = conv.weight.data.T.contiguous()
    linear.bias.data = conv.bias.data.clone()
    return linear


def _with_linears(model: nn.Module) -> nn.Module:
    """`model` with every `Conv1D` swapped for its `nn.Linear`."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Conv1D):
            model.set_submodule(name, _linear_of(module))
    return model


def test_a_conv1d_is_quantized_as_the_linear_of_its_transposed_weight():
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(96, 64))
    linear = _linear_of(model[0])
    x = torch.randn(3, 64)
    assert torch.allclose(as_linear(model[0])(x), model[0](x), atol=1e-6)
    assert build_plan(model, CONFIG).layers["0"].in_features == 64
    expected = CustomBitsLinear.from_linear(linear, CONFIG)
    quantlab.quantize(model, CONFIG, progress=False)
    stored = model[0].stored_tensors()
    assert all(torch.equal(tensor, stored[name]) for name, tensor in expected.stored_tensors().items())
    assert torch.equal(model[0].bias, linear.bias) and torch.equal(model[0](x), expected(x))


def test_gptq_solves_gpt2_as_the_same_model_with_linear_layers():
    config = CustomBitsConfig(**RTN, solver="gptq", calibration_samples=4, calibration_seq_len=32)
    windows = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    convs, linears = tiny_causal_lm("gpt2"), _with_linears(tiny_causal_lm("gpt2"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model in (convs, linears):
            quantlab.quantize(model, config, calibration=windows, progress=False)
    got, expected = quantized_layers(convs), quantized_layers(linears)
    assert list(got) == list(expected) and len(got) == 8
    for name, layer in expected.items():
        stored = got[name].stored_tensors()
        assert all(torch.equal(tensor, stored[tensor_name]) for tensor_name, tensor in layer.stored_tensors().items())


def test_a_transposed_kind_is_registered_by_class():
    class Projection(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64, 32))
            self.bias = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight

    assert not is_quantizable_linear(Projection())
    register_linear_kind(Projection, transposed=True)
    assert is_quantizable_linear(Projection()) and as_linear(Projection()).out_features == 32
    with pytest.raises(TypeError, match=r"an nn\.Linear subclass"):
        register_linear_kind(Projection)


def test_mixed_precision_chooses_gpt2s_widths_within_its_budget():
    from quantlab.eval.size import stored_bits_per_weight

    windows = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    config = CustomBitsConfig(**RTN, target_bits=3.5, solver="gptq", calibration_samples=4, calibration_seq_len=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = quantlab.quantize(tiny_causal_lm("gpt2"), config, calibration=windows, progress=False)
    chosen = model.config.quantization_config.layer_options
    assert chosen and set(chosen) <= set(quantized_layers(model))
    assert len({options["bits"] for options in chosen.values()}) > 1
    assert stored_bits_per_weight(model) <= 3.5
