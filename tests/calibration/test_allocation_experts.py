"""Mixed precision on mixtures of experts: each fused experts projection is one allocation unit, all its experts on
one of the candidates, its predicted loss summed over its experts on their routed tokens."""

import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.calibration.allocation import choose, measure_layers
from quantlab.calibration.experts import unfuse_experts
from quantlab.calibration.sensitivity import output_fisher
from quantlab.errors import DataFreeExpertsWarning
from quantlab.eval.size import stored_bits_per_weight
from quantlab.loading import load_tokenizer
from quantlab.nn.quantized_experts import PROJECTIONS, QuantizedExperts
from quantlab.plan import build_plan
from quantlab.replacement import quantized_experts
from quantlab.saving import save_quantized
from quantlab.testing import byte_tokenizer
from quantlab.testing.architectures import tiny_causal_lm
from quantlab.workflows.quantize import quantize_to_checkpoint

MIXTURES = ["qwen3_moe", "mixtral"]
CALIBRATION = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(0))
UNIFORM = {"bits": 3, "group_size": 32, "symmetric": True}  # 3.5 bits per weight with its float16 scales
TARGET = 3.6


def _config(**options) -> quantlab.CustomBitsConfig:
    return quantlab.CustomBitsConfig(bits=3, group_size=32, target_bits=TARGET, solver="gptq", **options)


def _quantized(model_type: str, config: quantlab.CustomBitsConfig) -> torch.nn.Module:
    model = tiny_causal_lm(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataFreeExpertsWarning)  # an expert routed few tokens: tested elsewhere
        quantlab.quantize(model, config, calibration=CALIBRATION, progress=False)
    return model


def _options(config: quantlab.CustomBitsConfig) -> dict:
    return {name: getattr(config, name) for name in UNIFORM}


@pytest.mark.parametrize("model_type", MIXTURES)
def test_a_mixture_meets_its_budget_with_each_experts_projection_on_a_candidate(model_type):
    config = _config()
    model = _quantized(model_type, config)
    assert TARGET - 0.25 < stored_bits_per_weight(model) <= TARGET  # from the stored tensors, experts included
    candidates = config.allocation_candidates()
    experts = quantized_experts(model)
    assert len(experts) == 2 and all(isinstance(module, QuantizedExperts) for module in experts.values())
    chosen = {}
    for name, module in experts.items():
        for projection in PROJECTIONS:
            chosen[f"{name}.{projection}"] = _options(module.configs[projection])
            assert chosen[f"{name}.{projection}"] in candidates
            assert module.configs[projection] == config.config_for(f"{name}.{projection}")  # as saved
    assert any(name in config.layer_options for name in chosen)  # the experts were allocated, not left as bits=3
    routers = [w.name for w in model.hf_quantizer.plan.left_float if w.why.startswith("router")]
    assert len(routers) == 2 and not any(router.rpartition(".")[0] in config.layer_options for router in routers)
    widths = {layer.config.bits for layer in quantlab.replacement.quantized_layers(model).values()}
    assert len(widths | {options["bits"] for options in chosen.values()}) > 1


@pytest.mark.parametrize("model_type", MIXTURES)
def test_the_chosen_predicted_loss_is_no_worse_than_the_uniform_width_it_costs_no_more_than(model_type):
    model = tiny_causal_lm(model_type)
    plan = build_plan(model, _config())
    measured, weights = measure_layers(model, plan, CALIBRATION, progress=False)
    projections = [name for name in measured if name.rpartition(".")[2] in PROJECTIONS]
    assert len(projections) == 4 and weights == sum(layer.weights for layer in plan.layers.values())
    uniform = {name: next(c for c in options if dict(c.options) == UNIFORM) for name, options in measured.items()}
    uniform_bytes = sum(c.stored_bytes for c in uniform.values())
    experts = plan.layers[projections[0]]
    layout = plan.module_class.layout_for(
        experts.in_features, experts.out_features, plan.config.for_one_layer(**UNIFORM)
    )
    assert uniform[projections[0]].stored_bytes == experts.experts * layout.stored_bytes()  # every slice's bytes
    budget = int(TARGET * weights / 8)
    assert 8 * uniform_bytes / weights == 3.5 and uniform_bytes <= budget
    chosen = choose(measured, budget, TARGET, weights)
    assert sum(c.stored_bytes for c in chosen.values()) <= budget
    assert sum(c.loss for c in chosen.values()) < sum(c.loss for c in uniform.values())


def test_expert_calibration_all_measures_the_experts_on_every_token():
    """The experts' statistics follow the calibration's (every token under "all"); the other layers' do not move."""
    model = tiny_causal_lm("mixtral")
    routed, _ = measure_layers(model, build_plan(model, _config()), CALIBRATION, progress=False)
    every, _ = measure_layers(model, build_plan(model, _config(expert_calibration="all")), CALIBRATION, progress=False)
    assert routed.keys() == every.keys()
    for name in routed:
        same = [a.loss == b.loss for a, b in zip(routed[name], every[name], strict=True)]
        assert all(same) if name.rpartition(".")[2] not in PROJECTIONS else not any(same), name


def test_each_expert_slice_fisher_is_the_gradient_at_that_experts_output():
    """Probed through the fused module (as the whole-model pass does, streamed or not), each slice's Fisher is the
    one of the same slice made a real `nn.Linear` of the model."""
    model = tiny_causal_lm("qwen3_moe")
    plan = build_plan(model, _config())
    names = [f"{name}.{expert}" for name, layer in plan.layers.items() if layer.experts for expert in range(8)]
    fused = output_fisher(model, CALIBRATION, names)
    for index, block in enumerate(model.model.layers):
        unfuse_experts(block, f"model.layers.{index}", plan)
    assert fused == output_fisher(model, CALIBRATION, names)
    assert all(value >= 0 for value in fused.values()) and sum(fused.values()) > 0


def test_a_pinned_experts_projection_keeps_its_options_and_counts_against_the_budget():
    name, options = "model.layers.0.mlp.experts.down_proj", {"bits": 8, "group_size": 32}
    config = _config(layer_options={name: dict(options)})
    model = _quantized("mixtral", config)
    down = model.model.layers[0].mlp.experts.configs["down_proj"]
    assert (down.bits, down.group_size) == (8, 32) and config.layer_options[name] == options
    assert TARGET - 0.25 < stored_bits_per_weight(model) <= TARGET


def test_a_mixed_mixture_saves_and_reloads_bit_identical(tmp_path):
    model = _quantized("qwen3_moe", _config())
    model.save_pretrained(tmp_path / "mixed")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mixed")
    assert reloaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(tensor, model.state_dict()[name]) for name, tensor in reloaded.state_dict().items())
    for name, experts in quantized_experts(reloaded).items():
        assert experts.configs == quantized_experts(model)[name].configs
    with torch.no_grad():
        assert torch.equal(reloaded(CALIBRATION[:2]).logits, model(CALIBRATION[:2]).logits)


@pytest.mark.parametrize("model_type", MIXTURES)
def test_the_streamed_workflow_writes_what_the_in_memory_path_writes(model_type, tmp_path):
    """The same choices (config.json byte for byte) and the same tensors; the in-memory file names some experts'
    tensors per expert (transformers' conversion on saving), the streamed one fused: both reload to one model."""
    source = tmp_path / "float"
    tiny_causal_lm(model_type).save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    options = {"calibration_samples": 8, "calibration_seq_len": 32}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataFreeExpertsWarning)
        report = quantize_to_checkpoint(source, _config(**options), tmp_path / "streamed")
        save_quantized(quantlab.load(source, _config(**options)), tmp_path / "in-memory", load_tokenizer(source))
    assert report.streamed and any(".mlp.experts." in name for name in report.config["layer_options"])
    streamed, in_memory = (tmp_path / name for name in ("streamed", "in-memory"))
    assert (streamed / "config.json").read_bytes() == (in_memory / "config.json").read_bytes()
    written = [load_file(folder / "model.safetensors") for folder in (streamed, in_memory)]
    assert all(torch.equal(written[0][name], written[1][name]) for name in written[0].keys() & written[1].keys())
    reloaded = [AutoModelForCausalLM.from_pretrained(folder).state_dict() for folder in (streamed, in_memory)]
    assert reloaded[0].keys() == reloaded[1].keys()
    assert all(torch.equal(tensor, reloaded[1][name]) for name, tensor in reloaded[0].items())
