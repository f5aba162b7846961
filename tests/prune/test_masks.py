"""Mask computation, patterns and the cubic schedule: pure functions, exact counts."""

import itertools

import pytest
import torch

from quantlab.errors import ConfigError
from quantlab.prune import (
    PruningError,
    check_sparsity,
    cubic_sparsity,
    global_magnitude_masks,
    magnitude_mask,
    nm_mask,
    parse_pattern,
)
from quantlab.prune.mask_rules import follows_nm, smallest_k_mask
from quantlab.prune.patterns import resolve_sparsity


def test_smallest_k_mask_removes_exactly_k_even_with_ties():
    scores = torch.tensor([[0.5, 0.1, 0.1], [0.1, 0.1, 0.9]])  # four tied lowest scores
    mask = smallest_k_mask(scores, 3)
    assert int((~mask).sum()) == 3
    assert bool(mask[0, 0]) and bool(mask[1, 2])  # the two largest survive


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.9])
def test_magnitude_mask_removes_the_smallest_weights(sparsity):
    weight = torch.randn(32, 48)
    mask = magnitude_mask(weight, sparsity)
    removed = int((~mask).sum())
    assert removed == round(weight.numel() * sparsity)
    if 0 < removed < weight.numel():
        assert weight.abs()[~mask].max() <= weight.abs()[mask].min()


def test_global_masks_rank_all_layers_together():
    small, large = torch.rand(16, 16) * 0.01, 1 + torch.rand(16, 16)
    masks = global_magnitude_masks({"small": small, "large": large}, 0.5)
    assert int((~masks["small"]).sum()) == 256  # every small weight goes before any large one
    assert bool(masks["large"].all())


@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 8), (1, 4)])
def test_nm_mask_keeps_the_n_largest_of_every_m(n, m):
    weight = torch.randn(8, 32)
    mask = nm_mask(weight, n, m)
    groups = mask.reshape(8, -1, m)
    assert bool((groups.sum(-1) == n).all())
    kept = (weight.abs() * mask).reshape(8, -1, m)
    dropped = (weight.abs() * ~mask).reshape(8, -1, m)
    assert bool((kept.masked_fill(~groups, float("inf")).amin(-1) >= dropped.amax(-1)).all())
    assert follows_nm(mask, n, m)


def test_nm_pattern_that_does_not_divide_the_layer_is_an_error():
    with pytest.raises(PruningError, match=r"in_features=30.*4 does not divide"):
        nm_mask(torch.randn(4, 30), 2, 4, layer="model.layers.0.mlp.up_proj")


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), "half", True])
def test_sparsity_outside_zero_one_is_an_error(bad):
    with pytest.raises(ConfigError, match=r"in \[0, 1\)"):
        check_sparsity(bad)


def test_patterns_parse_and_fix_their_sparsity():
    assert parse_pattern("2:4").sparsity == 0.5
    assert parse_pattern("4:8").sparsity == 0.5
    assert parse_pattern("Unstructured").kind == "unstructured"
    assert resolve_sparsity(parse_pattern("2:4"), None) == 0.5
    with pytest.raises(ConfigError, match=r"sparsity 0\.5"):
        resolve_sparsity(parse_pattern("2:4"), 0.7)
    with pytest.raises(ConfigError, match="needs a sparsity"):
        resolve_sparsity(parse_pattern("unstructured"), None)
    for bad in ("4:2", "0:4", "2-4", "blocky"):
        with pytest.raises(ConfigError):
            parse_pattern(bad)


def test_cubic_schedule_follows_zhu_and_gupta():
    initial, final, start, end = 0.1, 0.9, 10, 110
    assert cubic_sparsity(0, initial, final, start, end) == initial
    assert cubic_sparsity(start, initial, final, start, end) == pytest.approx(initial)
    assert cubic_sparsity(end, initial, final, start, end) == final
    assert cubic_sparsity(10_000, initial, final, start, end) == final
    halfway = final + (initial - final) * 0.5**3
    assert cubic_sparsity(60, initial, final, start, end) == pytest.approx(halfway)
    values = [cubic_sparsity(t, initial, final, start, end) for t in range(start, end + 1)]
    steps = [b - a for a, b in itertools.pairwise(values)]
    assert all(s >= 0 for s in steps) and steps[0] > steps[-1]  # rises fast first, then slows


def test_cubic_schedule_holds_between_update_steps():
    values = [cubic_sparsity(t, 0.0, 0.8, 0, 100, frequency=10) for t in range(0, 30)]
    assert values[0:10] == [values[0]] * 10
    assert values[10:20] == [values[10]] * 10
    assert values[20] > values[10] > values[0]
