"""Import: checkpoints written by the compressed-tensors library's own compressor load into quantlab's storage
with the source's codes, scales and zero points, and compute what transformers computes from them."""

import json

import pytest
import torch
from safetensors import safe_open

import quantlab
from quantlab.cli.main import main
from quantlab.export import to_compressed_tensors
from quantlab.formats import grouping
from quantlab.nn import QuantizedLinear
from quantlab.testing import tiny_llama
from quantlab.testing.models import tiny_qwen2

pytest.importorskip("compressed_tensors")

IDS = torch.arange(5, 45).reshape(2, 20) % 256
INT4_SYM = {"num_bits": 4, "symmetric": True, "group_size": 32, "strategy": "group"}
INT4_ASYM = {"num_bits": 4, "symmetric": False, "group_size": 32, "strategy": "group"}
INT8_CHANNEL = {"num_bits": 8, "symmetric": True, "strategy": "channel"}
INT8_ASYM = {"num_bits": 8, "symmetric": False, "group_size": 32, "strategy": "group"}

CASES = {
    "llama-int4-sym": (tiny_llama, {"group_0": INT4_SYM}, "pack-quantized", "custom_bits"),
    "llama-int4-asym": (tiny_llama, {"group_0": INT4_ASYM}, "pack-quantized", "custom_bits"),
    "qwen2-int4-asym": (tiny_qwen2, {"group_0": INT4_ASYM}, "pack-quantized", "custom_bits"),
    "qwen2-int8-channel": (tiny_qwen2, {"group_0": INT8_CHANNEL}, "pack-quantized", "int8"),
    "llama-int8-asym-unpacked": (tiny_llama, {"group_0": INT8_ASYM}, "naive-quantized", "custom_bits"),
    "qwen2-mixed": (
        tiny_qwen2,
        {"group_0": INT4_SYM, "group_1": {**INT8_CHANNEL, "targets": ["re:.*down_proj$"]}},
        "pack-quantized",
        "custom_bits",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_codes_scales_and_zero_points_are_the_sources(compressed_tensors_writer, tmp_path, case) -> None:
    build, schemes, fmt, method = CASES[case]
    source = compressed_tensors_writer(build(), tmp_path / "ct", schemes, fmt)
    model = quantlab.load(tmp_path / "ct")
    assert model.config.quantization_config.method == method
    layers = {name: module for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    assert sorted(layers) == sorted(source)
    for name, numbers in source.items():
        layer, midpoint = layers[name], 1 << (numbers["bits"] - 1)
        codes, _ = layer.codes_and_params()
        signed = grouping.ungroup(codes, layer.in_features).to(torch.int16) - midpoint
        assert torch.equal(signed, numbers["codes"].to(torch.int16)), name
        assert layer.weight_scale.dtype == numbers["scale"].dtype
        assert torch.equal(layer.weight_scale, numbers["scale"].reshape(layer.weight_scale.shape)), name
        if numbers["zero"] is not None:
            zero = numbers["zero"].to(torch.int16).reshape(layer.weight_zero.shape) + midpoint
            assert torch.equal(layer.weight_zero, zero.to(layer.weight_zero.dtype)), name
        else:
            assert layer.layout.has_zero is False
    if case == "qwen2-mixed":
        assert model.model.layers[0].mlp.down_proj.layout.bits == 8
        assert model.model.layers[0].mlp.up_proj.layout.bits == 4


@pytest.mark.parametrize("case", ["llama-int4-asym", "qwen2-int8-channel", "qwen2-mixed"])
def test_logits_match_transformers_loading_the_same_checkpoint(compressed_tensors_writer, tmp_path, case) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    build, schemes, fmt, _ = CASES[case]
    compressed_tensors_writer(build(), tmp_path / "ct", schemes, fmt)
    # transformers' default path leaves asymmetric zero points packed (a size mismatch): those are dequantized
    # while loading, a path that decodes every layer with one scheme, so mixed schemes take the default one.
    asymmetric = any(not options.get("symmetric", True) for options in schemes.values())
    options = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if asymmetric else {}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", **options)
    model = quantlab.load(tmp_path / "ct")
    with torch.no_grad():
        expected, logits = reference(IDS).logits, model(IDS).logits
    assert float((logits - expected).abs().max() / expected.abs().max()) <= 1e-4


def test_asymmetric_checkpoint_exports_back_to_the_same_tensors(compressed_tensors_writer, tmp_path) -> None:
    compressed_tensors_writer(tiny_qwen2(), tmp_path / "ct", {"group_0": INT4_ASYM})
    to_compressed_tensors(quantlab.load(tmp_path / "ct"), tmp_path / "back")
    with (
        safe_open(tmp_path / "ct" / "model.safetensors", "pt") as a,
        safe_open(tmp_path / "back" / "model.safetensors", "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():  # noqa: SIM118 (a safe_open handle is no mapping)
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    written = json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"]
    assert written["config_groups"]["group_0"]["weights"]["symmetric"] is False


def test_bfloat16_scales_are_kept(compressed_tensors_writer, tmp_path) -> None:
    source = compressed_tensors_writer(tiny_llama().to(torch.bfloat16), tmp_path / "ct", {"group_0": INT4_SYM})
    model = quantlab.load(tmp_path / "ct")
    assert model.config.quantization_config.scale_dtype == "bfloat16"
    layer = model.model.layers[1].self_attn.o_proj
    assert torch.equal(layer.weight_scale, source["model.layers.1.self_attn.o_proj"]["scale"])


def test_commands_open_it(compressed_tensors_writer, tmp_path, capsys) -> None:
    compressed_tensors_writer(tiny_llama(), tmp_path / "ct", {"group_0": INT4_ASYM})
    assert main(["inspect", str(tmp_path / "ct"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "custom_bits" in json.dumps(report)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the converted copy is gone


def test_static_activation_quantization_is_refused_in_one_line(compressed_tensors_writer, tmp_path, capsys) -> None:
    compressed_tensors_writer(tiny_llama(), tmp_path / "ct", {"group_0": INT4_SYM})
    config_file = tmp_path / "ct" / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "tensor",
        "dynamic": False,
    }
    config_file.write_text(json.dumps(config))
    assert main(["inspect", str(tmp_path / "ct")]) == 2
    err = capsys.readouterr().err
    assert err.count("quantlab: error:") == 1 and "activations with static scales" in err
    assert "Traceback" not in err
