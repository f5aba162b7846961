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
from quantlab.interop import ForeignCheckpointError
from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_experts import PROJECTIONS, QuantizedExperts
from quantlab.testing import tiny_llama
from quantlab.testing.architectures import tiny_causal_lm
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


# -- mixtures of experts ---------------------------------------------------------------------------

# The per-expert layers of a fused experts module: its block and the checkpoint's gate, up and down layers.
EXPERTS_LAYERS = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


def int4_experts(model_type: str, **options):
    """A tiny mixture of experts quantized by quantlab to int4 g32 (its scales in float16, the default)."""
    config = quantlab.CustomBitsConfig(**{"bits": 4, "group_size": 32, "symmetric": True, **options})
    return quantlab.quantize(tiny_causal_lm(model_type), config, progress=False)


def experts_int8(model_type: str):
    """Experts in int8 per channel, every other layer in int4 g32."""
    projections = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in PROJECTIONS]
    return int4_experts(model_type, layer_options={name: {"bits": 8, "group_size": None} for name in projections})


EXPORTED = {
    "qwen3_moe": lambda: int4_experts("qwen3_moe"),
    "mixtral": lambda: int4_experts("mixtral"),
    "qwen3_moe-layer0-experts-float": lambda: int4_experts(
        "qwen3_moe", modules_to_not_convert=["lm_head", "model.layers.0.mlp.experts"]
    ),
    "mixtral-experts-int8": lambda: experts_int8("mixtral"),
}


def quantized_experts(model) -> dict[str, QuantizedExperts]:
    return {name: module for name, module in model.named_modules() if isinstance(module, QuantizedExperts)}


@pytest.mark.parametrize("case", EXPORTED)
def test_exported_experts_import_with_the_exporting_models_codes_scales_and_logits(tmp_path, case) -> None:
    model = EXPORTED[case]()
    to_compressed_tensors(model, tmp_path / "ct")
    loaded = quantlab.load(tmp_path / "ct")
    imported = quantized_experts(loaded)
    assert sorted(imported) == sorted(quantized_experts(model))
    for name, experts in quantized_experts(model).items():
        for stored, tensor in experts.stored_tensors().items():  # scales widened to float32 by the export, exactly
            assert torch.equal(getattr(imported[name], stored), tensor.to(getattr(imported[name], stored).dtype))
        for projection in PROJECTIONS:
            expected = experts.dequantize_projection(projection)
            assert torch.equal(imported[name].dequantize_projection(projection), expected), (name, projection)
    with torch.no_grad():
        logits, expected = loaded(IDS).logits, model(IDS).logits
    if "float" in case:  # float experts: torch's float products may split their sums by thread count
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(logits, expected)


def test_imported_experts_save_as_quantlab_writes_them_and_reload(tmp_path) -> None:
    model = int4_experts("mixtral")
    to_compressed_tensors(model, tmp_path / "ct")
    quantlab.load(tmp_path / "ct").save_pretrained(tmp_path / "saved")
    with safe_open(tmp_path / "saved" / "model.safetensors", "pt") as handle:
        stored = set(handle.keys())
    assert "model.layers.1.block_sparse_moe.experts.gate_up_proj_scale" in stored  # companions fused, as quantlab's
    assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in stored  # codes per expert, as transformers'
    with torch.no_grad():
        assert torch.equal(quantlab.load(tmp_path / "saved")(IDS).logits, model(IDS).logits)


EXPERTS_DOWN_INT8 = {"group_0": INT4_SYM, "group_1": {**INT8_CHANNEL, "targets": [r"re:.*experts\.\d+\.down_proj$"]}}
EXPERTS_CASES = {
    "qwen3_moe-int4": ("qwen3_moe", {"group_0": INT4_SYM}),
    "mixtral-int4": ("mixtral", {"group_0": INT4_SYM}),
    "qwen3_moe-experts-down-int8": ("qwen3_moe", EXPERTS_DOWN_INT8),
}


@pytest.mark.parametrize("case", EXPERTS_CASES)
def test_experts_compressed_tensors_wrote_import_with_its_codes_and_scales(
    compressed_tensors_experts_writer, tmp_path, case
) -> None:
    model_type, schemes = EXPERTS_CASES[case]
    source = compressed_tensors_experts_writer(tiny_causal_lm(model_type), tmp_path / "ct", schemes)
    model = quantlab.load(tmp_path / "ct")
    block, gate, up, down = EXPERTS_LAYERS[model_type]
    imported = quantized_experts(model)
    assert sorted(imported) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for name, experts in imported.items():
        checkpoint = name.replace(".mlp.", f".{block}.")
        for projection, layers in (("gate_up_proj", (gate, up)), ("down_proj", (down,))):
            for expert, piece in enumerate(experts.slices(projection)):
                grid = piece.layout.codec_object.integer_grid(piece.layout, piece.stored_tensors())
                numbers = [source[f"{checkpoint}.{expert}.{layer}"] for layer in layers]
                codes = torch.cat([n["codes"] for n in numbers]).to(torch.int16)
                assert torch.equal(grid.codes.to(torch.int16) - (1 << (grid.bits - 1)), codes), (name, expert)
                assert torch.equal(grid.scale, torch.cat([n["scale"] for n in numbers]).reshape(grid.scale.shape))
    assert imported["model.layers.0.mlp.experts"].layouts["down_proj"].bits == (8 if "int8" in case else 4)


@pytest.mark.parametrize("case", ["qwen3_moe-int4", "mixtral-int4"])
def test_experts_logits_match_transformers_loading_the_same_checkpoint(
    compressed_tensors_experts_writer, tmp_path, case
) -> None:
    from transformers import AutoModelForCausalLM

    model_type, schemes = EXPERTS_CASES[case]
    compressed_tensors_experts_writer(tiny_causal_lm(model_type), tmp_path / "ct", schemes)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ct")  # decodes the experts while loading
    model = quantlab.load(tmp_path / "ct")
    with torch.no_grad():
        expected, logits = reference(IDS).logits, model(IDS).logits
    assert float((logits - expected).abs().max() / expected.abs().max()) <= 1e-4


def test_experts_left_float_by_compressed_tensors_import_as_float_experts(
    compressed_tensors_experts_writer, tmp_path
) -> None:
    float_model = tiny_causal_lm("qwen3_moe")
    ignore = (r"re:.*layers\.0\.mlp\.experts\..*",)
    compressed_tensors_experts_writer(tiny_causal_lm("qwen3_moe"), tmp_path / "ct", {"group_0": INT4_SYM}, ignore)
    model = quantlab.load(tmp_path / "ct")
    assert sorted(quantized_experts(model)) == ["model.layers.1.mlp.experts"]
    for projection in PROJECTIONS:
        kept = getattr(model.model.layers[0].mlp.experts, projection)
        assert torch.equal(kept, getattr(float_model.model.layers[0].mlp.experts, projection))


@pytest.mark.parametrize(
    ("schemes", "ignore", "message"),
    [
        (
            {"group_0": INT4_SYM, "group_1": {**INT8_CHANNEL, "targets": [r"re:.*experts\.\d+\.up_proj$"]}},
            (),
            "model.layers.0.mlp.experts.0.up_proj (int8 per channel sym, float32 scales) is merged into "
            "model.layers.0.mlp.experts.gate_up_proj with experts' layers in int4 g32 sym, float32 scales; quantlab "
            "stores a fused experts projection in one scheme",
        ),
        (
            {"group_0": INT4_SYM},
            (r"re:.*experts\.0\..*",),
            "model.layers.0.mlp.experts: the checkpoint stores some of its experts' weights quantized and others in "
            "float; quantlab holds an experts module all quantized or all float",
        ),
    ],
    ids=["gate-and-up-in-two-schemes", "some-experts-float"],
)
def test_experts_quantlab_cannot_hold_are_refused_in_one_line(
    compressed_tensors_experts_writer, tmp_path, schemes, ignore, message
) -> None:
    compressed_tensors_experts_writer(tiny_causal_lm("qwen3_moe"), tmp_path / "ct", schemes, ignore)
    with pytest.raises(ForeignCheckpointError) as caught:
        quantlab.load(tmp_path / "ct")
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
