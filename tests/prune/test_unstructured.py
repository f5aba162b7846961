"""One-shot pruning of a tiny Llama: exact sparsity, the output head left dense, masks attached."""

import pytest
import torch

import quantlab
from quantlab.errors import ConfigError
from quantlab.prune import PruningError, make_permanent, mask_of, masked_layers, prunable_layers, prune
from quantlab.prune.mask_rules import follows_nm
from quantlab.testing import tiny_llama


def test_per_layer_pruning_reaches_the_sparsity_in_every_layer():
    model = tiny_llama()
    result = prune(model, "unstructured", 0.6)
    assert len(result.layers) == 14  # 7 projections x 2 layers; lm_head left out
    for name, layer in masked_layers(model).items():
        zeros = float((layer.weight == 0).float().mean())
        assert zeros == pytest.approx(0.6, abs=1 / layer.weight.numel()), name
    assert mask_of(model.lm_head) is None
    assert not bool((model.lm_head.weight == 0).any())


def test_global_pruning_reaches_the_sparsity_overall_not_per_layer():
    model = tiny_llama()
    result = prune(model, "unstructured", 0.5, scope="global")
    assert result.achieved_sparsity == pytest.approx(0.5, abs=1e-6)
    per_layer = sorted(result.layers.values())
    assert per_layer[0] < 0.5 < per_layer[-1]


@pytest.mark.parametrize("pattern", ["2:4", "4:8"])
def test_nm_pruning_gives_a_valid_pattern(pattern):
    model = tiny_llama()
    n, m = (int(v) for v in pattern.split(":"))
    prune(model, pattern)
    for layer in masked_layers(model).values():
        assert follows_nm(layer.weight != 0, n, m)


def test_pruning_again_keeps_what_was_pruned():
    model = tiny_llama()
    prune(model, "unstructured", 0.3)
    first = {name: mask_of(layer).clone() for name, layer in masked_layers(model).items()}
    prune(model, "unstructured", 0.6)
    for name, layer in masked_layers(model).items():
        assert not bool((mask_of(layer) & ~first[name]).any())  # nothing pruned comes back


def test_make_permanent_removes_masks_and_keeps_zeros():
    model = tiny_llama()
    prune(model, "2:4")
    zeros = sum(int((layer.weight == 0).sum()) for layer in masked_layers(model).values())
    assert make_permanent(model) == 14
    assert masked_layers(model) == {}
    assert sum(int((layer.weight == 0).sum()) for layer in prunable_layers(model).values()) == zeros


def test_pruned_model_stays_an_ordinary_model():
    model = tiny_llama()
    prune(model, "unstructured", 0.5)
    assert set(model.state_dict()) == set(tiny_llama().state_dict())  # masks are not in the state dict
    x = torch.randint(0, 256, (2, 8))
    assert model(x).logits.shape == (2, 8, 256)


def test_bad_inputs_are_named():
    model = tiny_llama()
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        prune(model, "unstructured", 1.0)
    with pytest.raises(ConfigError, match="scope"):
        prune(model, "unstructured", 0.5, scope="row")
    with pytest.raises(ConfigError, match="global"):
        prune(model, "2:4", scope="global")
    with pytest.raises(PruningError, match="no module named"):
        prune(model, "unstructured", 0.5, modules=["model.layers.0.mlp.nope"])
    with pytest.raises(PruningError, match="3 does not divide"):
        prune(model, "1:3")  # in_features are 64 and 192: 3 divides 192 but not 64


def test_quantized_model_is_refused_with_the_order_to_follow():
    model = quantlab.quantize(tiny_llama(), quantlab.Int8SymmetricConfig())
    with pytest.raises(PruningError, match="prune the float model first, then quantize"):
        prune(model, "unstructured", 0.5)


def test_lora_adapters_are_not_pruned_only_their_base_layers():
    from quantlab.training import add_lora

    model = add_lora(tiny_llama(), r=2)
    result = prune(model, "unstructured", 0.5)
    assert len(result.layers) == 14
    assert all(name.endswith(".base_layer") for name in result.layers)
