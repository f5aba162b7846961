"""The quantization plan: the layers a config quantizes, each one's config and solver, what stays float and why."""

import warnings

import pytest
import torch
from torch import nn
from transformers import FalconConfig, FalconForCausalLM, GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM

import quantlab
from quantlab.errors import ConfigError, LeftInFloatWarning, QuantizationError
from quantlab.methods.custom_bits import CustomBitsConfig
from quantlab.plan import build_plan, register_linear_kind
from quantlab.testing import tiny_llama

CALIBRATED = {"calibration_samples": 4, "calibration_seq_len": 16}


def test_the_default_selection_keeps_the_head_and_plans_every_projection():
    model = tiny_llama()
    plan = build_plan(model, CustomBitsConfig(bits=4, group_size=32))
    assert len(plan.layers) == 14 and "lm_head" not in plan.layers
    layer = plan.layers["model.layers.0.mlp.down_proj"]
    assert (layer.in_features, layer.out_features) == (192, 64)
    assert (layer.layout.codec, layer.layout.bits, layer.layout.group_size, layer.solver) == ("affine", 4, 32, "rtn")
    assert plan.quantized_share() == 1.0 and not plan.unhandled()
    kept = {weight.name: weight.why for weight in plan.left_float}
    assert set(kept) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert plan.calibration is None and plan.solver.name == "rtn"


def test_a_calibrated_plan_names_its_data_and_the_data_free_rest():
    plan = build_plan(tiny_llama(), CustomBitsConfig(bits=4, group_size=32, solver="gptq", modules_to_not_convert=[]))
    assert plan.layers["model.layers.1.self_attn.q_proj"].solver == "gptq"
    assert plan.layers["lm_head"].solver == "mse"  # outside the blocks: no statistics reach it
    assert plan.data_free.solver == "mse" and plan.needs_calibration and plan.calibrates_blocks
    assert "windows of 256 tokens" in plan.calibration


def test_layer_options_and_mixed_precision_show_per_layer():
    options = {"model.layers.0.mlp.down_proj": {"bits": 8}}
    plan = build_plan(tiny_llama(), CustomBitsConfig(bits=4, group_size=32, layer_options=options))
    assert plan.layers["model.layers.0.mlp.down_proj"].layout.bits == 8
    assert plan.layers["model.layers.1.mlp.down_proj"].layout.bits == 4
    text = plan.describe()
    assert "model.layers.0.mlp.down_proj  64x192  affine  8-bit" in text
    assert "model.layers.{0-1}.self_attn.q_proj  64x64  affine  4-bit  g32" in text
    mixed = build_plan(tiny_llama(), CustomBitsConfig(bits=4, group_size=32, target_bits=3.5, **CALIBRATED))
    assert all(layer.allocated for layer in mixed.layers.values()) and "3.5 bits per weight" in mixed.describe()


def test_mixed_precision_choices_reach_the_plan():
    model = tiny_llama()
    config = CustomBitsConfig(bits=4, group_size=32, target_bits=3.5, **CALIBRATED)
    quantlab.quantize(model, config, calibration=torch.randint(0, 256, (4, 16)), progress=False)
    chosen = model.hf_quantizer.quantization_config.layer_options
    assert chosen and len({options["bits"] for options in chosen.values()}) > 1


def test_a_misnamed_layer_option_is_refused_before_any_work():
    with pytest.raises(ConfigError, match=r"layer_options names 'model\.layers\.9\.mlp\.up_proj'"):
        build_plan(tiny_llama(), CustomBitsConfig(layer_options={"model.layers.9.mlp.up_proj": {"bits": 8}}))


def test_falcon_linear_layers_are_quantized():
    torch.manual_seed(0)
    model = FalconForCausalLM(FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4))
    ids = torch.randint(0, 128, (1, 8))
    before = model(ids).logits
    quantlab.quantize(model, CustomBitsConfig(bits=8, group_size=32), progress=False)
    assert not any(type(m).__name__ == "FalconLinear" for m in model.modules())
    assert torch.allclose(model(ids).logits, before, atol=0.05)


def test_weights_no_module_handles_are_named_with_a_warning():
    class Table(nn.Module):  # a 3-D parameter nothing quantizes
        def __init__(self) -> None:
            super().__init__()
            self.cells = nn.Parameter(torch.zeros(4, 64, 32))

    model = nn.Sequential(nn.Linear(64, 64), Table())
    plan = build_plan(model, CustomBitsConfig(group_size=32))
    assert [(w.name, w.why) for w in plan.unhandled()] == [
        ("1.cells", "no quantized module for a 3-D parameter of Table")
    ]
    assert plan.quantized_share() == pytest.approx(64 * 64 / (64 * 64 + 4 * 64 * 32))
    assert "LEFT IN FLOAT: 1.cells [4 x 64 x 32]: no quantized module for a 3-D parameter of Table" in plan.describe()
    with pytest.warns(LeftInFloatWarning, match=r"1\.cells"):
        plan.warn()


def test_a_mixture_of_experts_plans_its_fused_projections_and_keeps_the_routers():
    config = MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
    )  # fmt: skip
    plan = build_plan(MixtralForCausalLM(config), CustomBitsConfig(bits=4, group_size=32))
    experts = plan.layers["model.layers.0.mlp.experts.gate_up_proj"]
    assert (experts.experts, experts.in_features, experts.out_features) == (4, 64, 256)
    assert plan.experts_modules == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert not plan.unhandled() and any("router" in weight.why for weight in plan.left_float)
    routers = 2 * 4 * 64
    assert plan.quantized_share() == pytest.approx(1 - routers / sum(layer.weights for layer in plan.layers.values()),
                                                   abs=1e-3)  # fmt: skip
    assert plan.selects("model.layers.1.mlp.experts.down_proj.3") and not plan.selects("model.layers.1.mlp.experts")
    assert "model.layers.{0-1}.mlp.experts.gate_up_proj  256x64  affine  4-bit  g32" in plan.describe()


def test_a_linear_subclass_with_its_own_forward_is_named_until_registered():
    class ScaledLinear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(64, 64), ScaledLinear(64, 64))
    plan = build_plan(model, CustomBitsConfig(group_size=32))
    assert list(plan.layers) == ["0"]
    assert [w.why for w in plan.unhandled()] == ["no quantized module for a ScaledLinear (an nn.Linear subclass with "
                                                 "its own forward)"]  # fmt: skip

    class PlainLinear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.weight, self.bias)

    register_linear_kind(PlainLinear)
    assert list(build_plan(nn.Sequential(PlainLinear(64, 64)), CustomBitsConfig(group_size=32)).layers) == ["0"]


def test_gpt2s_conv1d_layers_are_planned_as_linear_layers_of_their_transposed_weights():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    plan = build_plan(model, CustomBitsConfig(group_size=32))
    assert not plan.unhandled() and plan.quantized_share() == 1.0
    shapes = {name: (layer.out_features, layer.in_features) for name, layer in plan.layers.items()}
    assert shapes == {
        "transformer.h.0.attn.c_attn": (96, 32), "transformer.h.0.attn.c_proj": (32, 32),
        "transformer.h.0.mlp.c_fc": (128, 32), "transformer.h.0.mlp.c_proj": (32, 128),
    }  # fmt: skip


def test_a_model_with_no_layer_to_quantize_is_refused_in_one_line_naming_its_kind():
    class ScaledLinear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LeftInFloatWarning)
        with pytest.raises(QuantizationError, match=r"ScaledLinear layers, which no quantized module handles"):
            quantlab.quantize(nn.Sequential(ScaledLinear(64, 64)), CustomBitsConfig(group_size=32))


def test_the_plan_is_saved_in_dict_form():
    entry = build_plan(tiny_llama(), CustomBitsConfig(bits=3, group_size=32)).to_dict()
    assert entry["layers"]["model.layers.0.self_attn.k_proj"] == {
        "shape": [32, 64], "solver": "rtn", "format": "affine", "bits": 3, "group_size": 32,
    }  # fmt: skip
    assert entry["quantized_share"] == 1.0 and entry["left_float"][0]["name"] == "model.embed_tokens.weight"
