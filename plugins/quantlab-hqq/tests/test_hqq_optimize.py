"""The half-quadratic optimiser as pure functions, and the layer's use of it."""

import pytest
import torch

from quantlab.errors import ConfigError
from quantlab.formats import grouping
from quantlab_hqq import HqqConfig, HqqLinear, method
from quantlab_hqq.optimize import (
    initial_params,
    inlier_part,
    lp_error,
    optimize_affine_params,
    round_to_nearest_params,
    shrink_lp,
)

P = 0.7


def gaussian(rows: int = 256, columns: int = 1024, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 0.02


def heavy_tailed(rows: int = 256, columns: int = 1024, seed: int = 0) -> torch.Tensor:
    """Student-t with 3 degrees of freedom: the outliers of real LLM weights."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, columns, generator=generator)
    chi2 = torch.randn(rows, columns, 3, generator=generator).square().sum(-1)
    return normal / (chi2 / 3).sqrt() * 0.02


def total_error_ratio(weight: torch.Tensor, bits: int, group_size: int, norm: float, **options) -> float:
    """`sum |w - w_q|^norm` after optimisation over the same for round-to-nearest (1.0 = no change)."""
    grouped = grouping.group(weight, group_size)
    rtn = lp_error(grouped, round_to_nearest_params(grouped, bits), bits, norm).sum()
    optimized = lp_error(grouped, optimize_affine_params(grouped, bits, lp_norm=P, **options), bits, norm).sum()
    return float(optimized / rtn)


WEIGHTS = pytest.mark.parametrize("make_weight", [gaussian, heavy_tailed], ids=["gaussian", "student-t3"])
LAYOUTS = pytest.mark.parametrize(("bits", "group_size"), [(2, 32), (3, 64), (4, 64), (4, 128)])


@WEIGHTS
@LAYOUTS
def test_sparse_regime_lowers_lp_error_against_round_to_nearest(make_weight, bits, group_size):
    """With a strong coupling (beta = 10 grid steps) the shrinkage acts and the l_0.7 error drops."""
    assert total_error_ratio(make_weight(), bits, group_size, P, beta=10.0) < 0.99


@WEIGHTS
@LAYOUTS
def test_defaults_lower_squared_error_against_round_to_nearest(make_weight, bits, group_size):
    """At beta = 1 the steps are least-squares zero refits (robust to clipped weights)."""
    assert total_error_ratio(make_weight(), bits, group_size, 2.0) < 0.97


@WEIGHTS
def test_optimizing_the_scale_lowers_the_error_further(make_weight):
    for norm in (P, 2.0):
        zero_only = total_error_ratio(make_weight(), 3, 64, norm)
        assert total_error_ratio(make_weight(), 3, 64, norm, optimize_scale=True) < zero_only - 0.02


def test_search_starts_from_an_integer_zero_point():
    grouped = grouping.group(gaussian(), 64)
    rtn = round_to_nearest_params(grouped, 4)
    start = optimize_affine_params(grouped, 4, iterations=0)
    assert torch.equal(start.scale, rtn.scale)
    assert torch.equal(start.zero, rtn.zero.round())
    assert torch.equal(initial_params(grouped, 4).zero, start.zero)


def test_independent_of_the_weights_magnitude():
    """Residuals are measured in grid steps, so scaling the weights scales the grid and nothing else."""
    grouped = grouping.group(heavy_tailed(64, 512), 64)
    params = optimize_affine_params(grouped, 4)
    scaled = optimize_affine_params(grouped * 1024, 4)
    torch.testing.assert_close(scaled.scale, params.scale * 1024)
    torch.testing.assert_close(scaled.zero, params.zero)


def test_shrink_is_soft_thresholding_for_l1_and_keeps_only_large_residuals():
    x = torch.tensor([-3.0, -0.5, -0.05, 0.0, 0.05, 0.5, 3.0])
    torch.testing.assert_close(shrink_lp(x, beta=2.0, lp_norm=1.0), torch.tensor([-2.5, 0, 0, 0, 0, 0, 2.5]))
    shrunk = shrink_lp(x, beta=1.0, lp_norm=P)
    threshold = 1.0 ** (-1 / (2 - P))
    assert torch.equal(shrunk[x.abs() <= threshold], torch.zeros(5))
    assert torch.equal(shrunk.sign()[x.abs() > threshold], x.sign()[x.abs() > threshold])
    assert (shrunk.abs() <= x.abs()).all()


def test_inlier_part_is_the_residual_minus_its_shrinkage():
    residual = heavy_tailed(8, 256) * 200  # a few grid steps, some far beyond the threshold
    for beta in (0.5, 1.0, 10.0):
        torch.testing.assert_close(inlier_part(residual, beta, P), residual - shrink_lp(residual, beta, P))


def test_constant_and_tiny_groups_stay_exact_and_finite():
    weight = torch.zeros(4, 128)
    weight[1] = 0.25
    weight[2, :64] = -1.0
    weight[3] = torch.linspace(0, 1e-9, 128)  # its fp16 scale underflows to zero
    layer = HqqLinear.from_linear(torch.nn.Linear(128, 4), HqqConfig(bits=4, group_size=64))
    layer.load_stored(HqqLinear.quantize_weight(weight, layer.config))
    restored = layer.dequantize_weight()
    assert torch.isfinite(restored).all()
    torch.testing.assert_close(restored[:3], weight[:3], rtol=0, atol=1e-3)
    assert restored[3].abs().max() < 1e-8


def test_row_chunks_do_not_change_the_result(monkeypatch):
    weight = heavy_tailed(40, 192)
    config = HqqConfig(bits=3, group_size=64)
    whole = HqqLinear.quantize_weight(weight, config)
    monkeypatch.setattr(method, "MAX_WEIGHTS_PER_CHUNK", 7 * 192)
    chunked = HqqLinear.quantize_weight(weight, config)
    assert all(torch.equal(whole[name], chunked[name]) for name in whole)


def test_layer_beats_custom_bits_round_to_nearest():
    from quantlab import CustomBitsConfig
    from quantlab.methods.custom_bits import CustomBitsLinear

    linear = torch.nn.Linear(1024, 256)
    linear.weight.data = heavy_tailed()
    hqq = HqqLinear.from_linear(linear, HqqConfig(bits=4, group_size=64)).dequantize_weight()
    rtn = CustomBitsLinear.from_linear(linear, CustomBitsConfig(bits=4, group_size=64)).dequantize_weight()
    squared_error = lambda approx: (linear.weight.detach() - approx).square().sum()  # noqa: E731
    assert squared_error(hqq) < 0.95 * squared_error(rtn)


@pytest.mark.parametrize(
    "options",
    [{"lp_norm": 0.0}, {"lp_norm": 1.5}, {"iterations": -1}, {"beta": 0}, {"kappa": 0.5}, {"optimize_scale": "yes"}],
    ids=str,
)
def test_bad_options_are_refused(options):
    with pytest.raises(ConfigError, match=next(iter(options))):
        HqqConfig(**options)


def test_symmetric_is_not_an_option():
    assert "symmetric" not in HqqConfig.option_names()
    with pytest.raises(ConfigError, match="symmetric"):
        HqqConfig.from_options({"symmetric": True})
