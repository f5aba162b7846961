"""Mixed precision: the allocation meets the budget and is the best assignment the proxy knows."""

import itertools
import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.calibration.allocation import Candidate, choose
from quantlab.errors import ConfigError
from quantlab.eval.size import stored_bits_per_weight
from quantlab.replacement import quantized_layers
from quantlab.testing.models import tiny_llama, tiny_llama_checkpoint

CALIBRATION = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(0))


def _random_problem(layers: int, seed: int) -> dict[str, list[Candidate]]:
    rng = random.Random(seed)
    problem = {}
    for layer in range(layers):
        size = rng.choice([100, 300])
        problem[f"l{layer}"] = [
            Candidate((("bits", bits),), size * bits, rng.uniform(0.5, 2) * size * 4.0**-bits) for bits in (2, 3, 4, 8)
        ]
    return problem


@pytest.mark.parametrize("seed", range(5))
def test_choice_fits_the_budget_and_is_near_the_best_assignment(seed):
    problem = _random_problem(5, seed)
    weights = sum(c.stored_bytes for c in problem["l0"][:1]) * 0 + sum(
        options[0].stored_bytes // 2 for options in problem.values()
    )
    budget = int(sum(options[1].stored_bytes for options in problem.values()) * 1.1)
    chosen = choose(problem, budget, target_bits=3.3, weights=weights)
    assert sum(c.stored_bytes for c in chosen.values()) <= budget
    best = min(
        sum(c.loss for c in combo)
        for combo in itertools.product(*problem.values())
        if sum(c.stored_bytes for c in combo) <= budget
    )
    assert sum(c.loss for c in chosen.values()) == pytest.approx(best, rel=1e-9)


def test_budget_outside_the_widths_is_refused():
    problem = _random_problem(3, 0)
    weights = sum(options[0].stored_bytes // 2 for options in problem.values())
    with pytest.raises(ConfigError, match=r"outside what the candidate widths can store .* choose a target"):
        choose(problem, budget=1, target_bits=0.1, weights=weights)


@pytest.mark.parametrize("target", [2.75, 3.5])
def test_mixed_model_meets_its_budget_and_mixes_widths(target):
    model = tiny_llama()
    config = quantlab.CustomBitsConfig(bits=3, group_size=64, target_bits=target, solver="gptq")
    quantlab.quantize(model, config, calibration=CALIBRATION, progress=False)
    assert stored_bits_per_weight(model) <= target
    assert stored_bits_per_weight(model) > target - 0.25
    widths = {layer.config.bits for layer in quantized_layers(model).values()}
    assert len(widths) > 1


def test_layers_the_user_names_keep_their_options_under_a_budget():
    """A user's `layer_options` are fixed choices: their bytes count, the other layers are chosen around them."""
    model = tiny_llama()
    pinned = {
        "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32},
        "model.layers.1.self_attn.q_proj": {"bits": 2},
    }
    config = quantlab.CustomBitsConfig(bits=3, group_size=64, target_bits=3.5, solver="gptq", layer_options=pinned)
    quantlab.quantize(model, config, calibration=CALIBRATION, progress=False)
    layers = quantized_layers(model)
    assert (
        layers["model.layers.0.mlp.down_proj"].config.bits,
        layers["model.layers.0.mlp.down_proj"].config.group_size,
    ) == (8, 32)
    assert layers["model.layers.1.self_attn.q_proj"].config.bits == 2
    assert all(config.layer_options[name] == options for name, options in pinned.items())
    assert 3.25 < stored_bits_per_weight(model) <= 3.5
    assert len({layer.config.bits for name, layer in layers.items() if name not in pinned}) > 1


def test_pinned_layers_count_against_the_budget_before_calibration():
    """Pinning the widest layer at 8 bits can make a budget unreachable: refused before any measurement."""
    model = tiny_llama()
    names = [f"model.layers.{i}.mlp.{part}_proj" for i in range(2) for part in ("gate", "up", "down")]
    pinned = {name: {"bits": 8, "group_size": 32} for name in names}
    config = quantlab.CustomBitsConfig(bits=3, group_size=64, target_bits=2.5, solver="gptq", layer_options=pinned)
    with pytest.raises(ConfigError, match=r"target_bits=2.5 is outside what the candidate widths can store"):
        quantlab.quantize(model, config, calibration=CALIBRATION, progress=False)


def test_mixed_beats_the_uniform_width_it_costs_no_more_than():
    unseen = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
    reference = tiny_llama()
    with torch.no_grad():
        expected = reference(unseen).logits

    def error(config):
        model = tiny_llama()
        quantlab.quantize(model, config, calibration=CALIBRATION, progress=False)
        with torch.no_grad():
            return (model(unseen).logits - expected).square().mean().item(), stored_bits_per_weight(model)

    uniform, uniform_bits = error(quantlab.CustomBitsConfig(bits=3, group_size=64, solver="gptq"))
    mixed, mixed_bits = error(quantlab.CustomBitsConfig(bits=3, group_size=64, target_bits=uniform_bits, solver="gptq"))
    assert mixed_bits <= uniform_bits
    assert mixed < uniform


def test_layer_options_are_checked():
    with pytest.raises(ConfigError, match="may only override the method's own options"):
        quantlab.CustomBitsConfig(layer_options={"model.layers.0.mlp.up_proj": {"solver": "gptq"}})
    with pytest.raises(ConfigError, match="bits"):
        quantlab.CustomBitsConfig(layer_options={"model.layers.0.mlp.up_proj": {"bits": 9}})
    with pytest.raises(ConfigError, match="target_bits is not supported"):
        quantlab.NF4Config(target_bits=4.0)


@pytest.mark.parametrize("solver", ["rtn", "gptq"])
@pytest.mark.parametrize("entry", ["quantize", "from_pretrained"])
def test_layer_options_naming_no_layer_of_the_model_are_refused(solver, entry, tmp_path):
    """A misspelt layer name would otherwise leave that layer on the default options without a word."""
    config = quantlab.CustomBitsConfig(solver=solver, layer_options={"model.layers.0.mlp.down_prj": {"bits": 8}})
    expected = re.escape("'model.layers.0.mlp.down_prj', which is not a layer this model quantizes")
    with pytest.raises(ConfigError, match=expected):
        if entry == "quantize":
            quantlab.quantize(tiny_llama(), config, calibration=CALIBRATION, progress=False)
        else:
            AutoModelForCausalLM.from_pretrained(tiny_llama_checkpoint(tmp_path / "float"), quantization_config=config)


def test_learned_tables_take_a_budget_with_widths_and_group_sizes_chosen_per_layer(tmp_path):
    model = tiny_llama()
    config = quantlab.LutConfig(bits=3, group_size=64, target_bits=3.3, solver="gptq")
    quantlab.quantize(model, config, calibration=CALIBRATION, progress=False)
    assert 3.0 < stored_bits_per_weight(model) <= 3.3
    layers = quantized_layers(model).values()
    assert len({(layer.config.bits, layer.config.group_size) for layer in layers}) > 1
    assert all(type(layer).__name__ == "LutLinear" for layer in layers)
    model.save_pretrained(tmp_path / "mixed")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mixed")
    batch = CALIBRATION[:2]
    with torch.no_grad():
        assert torch.equal(reloaded(batch).logits, model(batch).logits)
