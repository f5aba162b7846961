"""Fused mixture-of-experts projections quantized expert by expert: stored, loaded, saved, calibrated, refused."""

import copy
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

import quantlab
from quantlab.errors import DataFreeExpertsWarning
from quantlab.kernels.experts import routed_linear_op
from quantlab.methods.custom_bits import CustomBitsConfig
from quantlab.methods.nf4 import NF4Config
from quantlab.nn.quantized_experts import QuantizedExperts, routed_tokens, stored_name

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


def test_dequantize_gives_the_float_experts_back(windows):
    model = quantlab.quantize(mixtral(), CustomBitsConfig(bits=8, group_size=32), progress=False)
    logits = model(windows["test"]).logits
    quantlab.dequantize(model)
    experts = model.model.layers[0].mlp.experts
    assert type(experts) is MixtralExperts and experts.gate_up_proj.shape == (4, 256, 64)
    assert torch.allclose(model(windows["test"]).logits, logits, atol=1e-4)


def test_the_native_step_refuses_a_mixture_of_experts_in_one_line():
    from quantlab.errors import ConfigError
    from quantlab.generation import compile_for_decoding

    model = quantlab.quantize(mixtral(), CustomBitsConfig(bits=4, group_size=32), progress=False)
    with pytest.raises(ConfigError, match="native_step runs") as caught:
        compile_for_decoding(model, native_step=True)
    assert "\n" not in str(caught.value)


# Every format QuantizedLinear stores: affine at 2-8 bits (symmetric or with zero points, per group or per
# channel), int8, NF4 (plain and double-quantized absmax), IQ4_NL, and a learned table (lut).
FORMATS = {
    "affine2": CustomBitsConfig(bits=2, group_size=32),
    "affine3-sym": CustomBitsConfig(bits=3, group_size=64, symmetric=True),
    "affine4": CustomBitsConfig(bits=4, group_size=32),
    "affine5-channel": CustomBitsConfig(bits=5, group_size=None, scale_dtype="float32"),
    "affine8": CustomBitsConfig(bits=8, group_size=32),
    "int8": quantlab.Int8SymmetricConfig(),
    "nf4": NF4Config(blocksize=32, double_quant=False),
    "nf4-double": NF4Config(blocksize=64),
    "iq4_nl": quantlab.IQ4NLConfig(),
    "lut3": quantlab.LutConfig(bits=3, group_size=32),
}


def eager_loop(experts: QuantizedExperts, x: torch.Tensor, top_k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts' output as a loop over the routed experts computes it, each slice through its kernel."""
    final = torch.zeros_like(x)
    gate_up, down = experts.slices("gate_up_proj"), experts.slices("down_proj")
    for expert, tokens, positions in routed_tokens(top_k, experts.num_experts):
        gate, up = gate_up[expert](x[tokens]).chunk(2, dim=-1)
        out = down[expert](experts.act_fn(gate) * up) * weights[tokens, positions, None]
        final.index_add_(0, tokens, out.to(final.dtype))
    return final


def quantized_experts(config) -> QuantizedExperts:
    torch.manual_seed(0)
    experts_config = mixtral_config()
    experts_config.intermediate_size = 64
    experts = MixtralExperts(experts_config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    layer_class = quantlab.registry.method_of(config).module_class
    return QuantizedExperts.from_float(experts, layer_class, {"gate_up_proj": config, "down_proj": config}, "e")


@pytest.mark.parametrize("config", list(FORMATS.values()), ids=list(FORMATS))
def test_the_routed_operator_computes_the_loop_over_experts_in_every_format(config):
    experts = quantized_experts(config)
    x = torch.randn(12, 64)
    # expert 0 gets 9 tokens, 2 none, and slot index 4 names no expert of the module (it adds nothing)
    top_k = torch.tensor([[0, 1]] * 5 + [[1, 3], [3, 0], [0, 3], [1, 0], [3, 1], [0, 4], [4, 1]])
    weights = torch.rand(12, 2)
    expected = eager_loop(experts, x, top_k, weights)
    with torch.no_grad():  # the operator quantlab::routed_linear, as in the compiled step
        out = experts(x, top_k, weights)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    x_grad = x.clone().requires_grad_()  # with gradients: the same function called directly
    out = experts(x_grad, top_k, weights)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    assert x_grad.grad is not None and x_grad.grad.abs().sum() > 0


def test_the_routed_operator_traces_its_shapes_and_keeps_the_input_dtype():
    experts = quantized_experts(CustomBitsConfig(bits=4, group_size=32))
    x, top_k, weights = torch.randn(5, 64), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    gate_up, down = experts.routed_arguments("gate_up_proj"), experts.routed_arguments("down_proj")
    torch.library.opcheck(routed_linear_op, (x, top_k, None, *gate_up))  # each pair's row: [tokens, k, 128]
    torch.library.opcheck(routed_linear_op, (torch.randn(5, 2, 64), top_k, weights, *down))  # summed: [tokens, 64]
    with torch.no_grad():
        half = experts(x.bfloat16(), top_k, weights)
    assert half.dtype == torch.bfloat16 and half.shape == (5, 64)
    torch.testing.assert_close(half.float(), eager_loop(experts, x, top_k, weights), rtol=0.05, atol=0.01)
