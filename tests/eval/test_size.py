import math

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import quantlab
from quantlab.errors import QuantlabError
from quantlab.eval.size import checkpoint_bits_per_weight, checkpoint_storage, stored_bits_per_weight
from quantlab.testing import tiny_llama


def expected_layer_bits(config, out_features: int, in_features: int) -> int:
    """Bits a layer must store, written out from each format's definition (not from its code)."""
    if isinstance(config, quantlab.Int8SymmetricConfig):
        groups = 1 if config.group_size is None else math.ceil(in_features / config.group_size)
        size = in_features if config.group_size is None else config.group_size
        return out_features * groups * (size * 8 + 32)
    if isinstance(config, quantlab.NF4Config):
        blocks = out_features * math.ceil(in_features / config.blocksize)
        codes = blocks * config.blocksize * 4
        if not config.double_quant:
            return codes + blocks * 32
        return codes + blocks * 8 + math.ceil(blocks / 256) * 32 + 32
    if isinstance(config, quantlab.CustomBitsConfig):
        groups = out_features * math.ceil(in_features / config.group_size)
        packed = math.ceil(config.group_size * config.bits / 8) * 8
        scale_bits = 16 if config.scale_dtype in ("float16", "bfloat16") else 32
        return groups * (packed + scale_bits * (1 if config.symmetric else 2))
    raise TypeError(config)


def save_single_linear(config, out_features: int, in_features: int, directory) -> nn.Module:
    model = quantlab.quantize(nn.Sequential(nn.Linear(in_features, out_features)), config)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors")
    return model


@pytest.mark.parametrize(
    ("config", "bits"),
    [
        (quantlab.NF4Config(blocksize=64, double_quant=True), 4 + 8 / 64 + 32 * 17 / (256 * 1024)),
        (quantlab.NF4Config(blocksize=64, double_quant=False), 4 + 32 / 64),
        (quantlab.CustomBitsConfig(bits=3, group_size=64), 3 + 2 * 16 / 64),
        (quantlab.CustomBitsConfig(bits=4, group_size=128), 4 + 2 * 16 / 128),
        (quantlab.CustomBitsConfig(bits=2, group_size=64, symmetric=True), 2 + 16 / 64),
        (quantlab.Int8SymmetricConfig(), 8 + 32 / 1024),
    ],
)
def test_bits_of_a_saved_layer_follow_the_format(tmp_path, config, bits):
    model = save_single_linear(config, 256, 1024, tmp_path)
    assert stored_bits_per_weight(model) == pytest.approx(bits, abs=1e-9)
    assert checkpoint_bits_per_weight(tmp_path, model=model) == pytest.approx(bits, abs=1e-9)


def test_nf4_double_quant_costs_the_qlora_figure(tmp_path):
    model = save_single_linear(quantlab.NF4Config(), 256, 1024, tmp_path)
    assert checkpoint_bits_per_weight(tmp_path, model=model) == pytest.approx(4.127, abs=5e-4)


@pytest.mark.parametrize(
    "config",
    [
        quantlab.Int8SymmetricConfig(),
        quantlab.NF4Config(),
        quantlab.NF4Config(double_quant=False),
        quantlab.CustomBitsConfig(bits=3, group_size=64),
        quantlab.CustomBitsConfig(bits=5, group_size=32, symmetric=True),
    ],
)
def test_saved_checkpoint_measures_every_quantized_layer(tmp_path, config):
    """A tiny Llama saved by save_pretrained: shapes come from config.json; 96-wide layers pad their groups."""
    model = quantlab.quantize(tiny_llama(), config)
    model.save_pretrained(tmp_path)
    storage = checkpoint_storage(tmp_path)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, quantlab.QuantizedLinear)}
    assert set(storage.layers) == set(linears)
    expected_bits = sum(expected_layer_bits(config, m.out_features, m.in_features) for m in linears.values())
    weights = sum(m.out_features * m.in_features for m in linears.values())
    assert storage.bits_per_weight == pytest.approx(expected_bits / weights, abs=1e-9)
    assert storage.bits_per_weight == pytest.approx(stored_bits_per_weight(model), abs=1e-9)
    assert storage.file_bytes == (tmp_path / "model.safetensors").stat().st_size
    assert storage.file_bytes > storage.quantized_bytes + storage.other_bytes  # plus the safetensors header


def test_float_bias_is_not_counted(tmp_path):
    config = quantlab.CustomBitsConfig(bits=4, group_size=64)
    model = save_single_linear(config, 128, 256, tmp_path)
    storage = checkpoint_storage(tmp_path, model=model)
    assert storage.bits_per_weight == pytest.approx(4.5)
    assert storage.other_bytes == 128 * 4  # the fp32 bias


def test_float_checkpoint_has_no_quantized_layer(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    storage = checkpoint_storage(tmp_path)
    assert storage.quantized_weights == 0
    with pytest.raises(QuantlabError, match="no quantized layer"):
        _ = storage.bits_per_weight
    with pytest.raises(QuantlabError, match="no quantized layer"):
        stored_bits_per_weight(tiny_llama())


def test_missing_files_are_explained(tmp_path):
    with pytest.raises(QuantlabError, match=r"no \.safetensors file"):
        checkpoint_bits_per_weight(tmp_path)
    save_file({"0.weight": torch.zeros(2, 2, dtype=torch.int8)}, tmp_path / "model.safetensors")
    with pytest.raises(QuantlabError, match="pass model="):
        checkpoint_bits_per_weight(tmp_path)
