"""The half-quadratic optimiser, as pure functions."""

import pytest
import torch

from quantlab.formats import grouping
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
