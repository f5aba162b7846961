"""Fused mixture-of-experts projections quantized expert by expert: stored, loaded, saved, calibrated, refused."""

import copy
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

import quantlab
from quantlab.errors import DataFreeExpertsWarning, QuantlabError
from quantlab.methods.custom_bits import CustomBitsConfig
from quantlab.methods.nf4 import NF4Config
from quantlab.nn.quantized_experts import QuantizedExperts, stored_name

CALIBRATED = {"calibration_samples": 8, "calibration_seq_len": 32}


def mixtral_config() -> MixtralConfig:
    return MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, max_position_embeddings=64,
    )  # fmt: skip


def mixtral(seed: int = 0) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    model = MixtralForCausalLM(mixtral_config()).eval()
    model.config._experts_implementation = "eager"  # the float reference routes as QuantizedExperts does
    return model


def copy_of(model: MixtralForCausalLM) -> MixtralForCausalLM:
    twin = type(model)(copy.deepcopy(model.config)).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out - reference).norm() / reference.norm()).item()


@pytest.fixture(scope="module")
def windows() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"calibration": torch.randint(0, 128, (8, 32), generator=generator),
            "test": torch.randint(0, 128, (4, 32), generator=generator)}  # fmt: skip


@pytest.mark.parametrize("config", [CustomBitsConfig(bits=8, group_size=32), NF4Config()], ids=["int8", "nf4"])
def test_each_expert_runs_on_its_own_codes(config):
    torch.manual_seed(0)
    experts_config = mixtral_config()
    experts_config._experts_implementation = "eager"
    experts = MixtralExperts(experts_config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    layer_class = quantlab.registry.method_of(config).module_class
    quantized = QuantizedExperts.from_float(experts, layer_class, {"gate_up_proj": config, "down_proj": config}, "e")
    assert quantized.gate_up_proj.shape[:2] == (4, 256) and quantized.gate_up_proj.dtype == torch.uint8
    x, top_k = torch.randn(10, 64), torch.randint(0, 4, (10, 2))
    weights = torch.rand(10, 2)
    dequantized = quantized.to_float()
    assert type(dequantized) is MixtralExperts
    assert torch.allclose(quantized(x, top_k, weights), dequantized(x, top_k, weights), atol=1e-5)
    bound = 0.02 if isinstance(config, CustomBitsConfig) else 0.25  # two chained 4-bit products
    assert relative_error(quantized(x, top_k, weights), experts(x, top_k, weights)) < bound
    for expert in range(4):  # every expert's slice stores what the method's Linear layer stores for it
        alone = layer_class.quantize_checked(experts.down_proj[expert], config, "down")
        assert all(torch.equal(quantized.stored_tensors()[stored_name("down_proj", n)][expert], t)
                   for n, t in alone.items())  # fmt: skip


def test_loading_quantizes_the_experts_and_the_saved_file_reloads_bit_identical(tmp_path, windows):
    model = mixtral()
    model.save_pretrained(tmp_path / "float")
    config = CustomBitsConfig(bits=4, group_size=32)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config)
    converted = quantlab.quantize(copy_of(model), CustomBitsConfig(bits=4, group_size=32), progress=False)
    assert isinstance(loaded.model.layers[1].mlp.experts, QuantizedExperts)
    assert loaded.state_dict().keys() == converted.state_dict().keys()
    assert all(torch.equal(tensor, converted.state_dict()[name]) for name, tensor in loaded.state_dict().items())
    logits = loaded(windows["test"]).logits
    loaded.save_pretrained(tmp_path / "quantized")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized")
    assert isinstance(reloaded.model.layers[0].mlp.experts, QuantizedExperts)
    assert torch.equal(reloaded(windows["test"]).logits, logits)
    generated = reloaded.generate(windows["test"][:1, :8], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 12)


def test_qwen3_moe_experts_are_quantized(windows):
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, head_dim=16,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config).eval()
    model.config._experts_implementation = "eager"
    reference = model(windows["test"]).logits
    quantlab.quantize(model, CustomBitsConfig(bits=8, group_size=32), progress=False)
    assert all(isinstance(layer.mlp.experts, QuantizedExperts) for layer in model.model.layers)
    assert relative_error(model(windows["test"]).logits, reference) < 0.05


def test_gptq_calibrates_every_expert_on_its_routed_tokens(windows):
    model = mixtral()
    reference = model(windows["test"]).logits
    errors, codes = {}, {}
    for name, options in {
        "rtn": {},
        "gptq": {"solver": "gptq"},
        "all": {"solver": "gptq", "expert_calibration": "all"},
    }.items():
        quantized = copy_of(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DataFreeExpertsWarning)  # 256 tokens: every expert gets enough
            quantlab.quantize(quantized, CustomBitsConfig(bits=3, group_size=32, **options, **CALIBRATED),
                              calibration=windows["calibration"], progress=False)  # fmt: skip
        errors[name] = relative_error(quantized(windows["test"]).logits, reference)
        codes[name] = quantized.model.layers[1].mlp.experts.down_proj
    assert errors["gptq"] < errors["rtn"] and errors["all"] < errors["rtn"]
    for expert in range(4):  # each expert's codes were solved, not rounded
        assert not torch.equal(codes["gptq"][expert], codes["rtn"][expert])
        assert not torch.equal(codes["all"][expert], codes["gptq"][expert])


def test_experts_given_too_few_tokens_are_quantized_data_free_and_named(windows):
    model = mixtral()
    config = CustomBitsConfig(bits=4, group_size=32, solver="gptq", calibration_samples=1, calibration_seq_len=16)
    with pytest.warns(DataFreeExpertsWarning, match="fewer than 16 calibration tokens"):
        quantlab.quantize(model, config, calibration=windows["calibration"][:1, :16], progress=False)
    noted = model.hf_quantizer.plan.data_free_experts
    assert isinstance(model.model.layers[0].mlp.experts, QuantizedExperts)
    assert noted and all(".mlp.experts." in name and why.endswith(": mse") for name, why in noted.items())


def test_exports_refuse_quantized_experts_in_one_line(tmp_path):
    from quantlab.export import to_onnx
    from quantlab.export.compressed_tensors import to_compressed_tensors

    model = quantlab.quantize(mixtral(), CustomBitsConfig(bits=4, group_size=32), progress=False)
    for export in (lambda: to_onnx(model, tmp_path / "m.onnx"), lambda: to_compressed_tensors(model, tmp_path / "ct")):
        with pytest.raises(QuantlabError, match="mixture of experts' quantized projections") as caught:
            export()
        assert "\n" not in str(caught.value)


def test_dequantize_gives_the_float_experts_back(windows):
    model = quantlab.quantize(mixtral(), CustomBitsConfig(bits=8, group_size=32), progress=False)
    logits = model(windows["test"]).logits
    quantlab.dequantize(model)
    experts = model.model.layers[0].mlp.experts
    assert type(experts) is MixtralExperts and experts.gate_up_proj.shape == (4, 256, 64)
    assert torch.allclose(model(windows["test"]).logits, logits, atol=1e-4)


def test_the_compiled_step_refuses_quantized_experts_in_one_graph():
    from quantlab.errors import ConfigError
    from quantlab.generation import compile_for_decoding

    model = quantlab.quantize(mixtral(), CustomBitsConfig(bits=4, group_size=32), progress=False)
    with pytest.raises(ConfigError, match="pass fullgraph=False"):
        compile_for_decoding(model)
    with pytest.raises(ConfigError, match="native_step runs"):
        compile_for_decoding(model, native_step=True, fullgraph=False)
