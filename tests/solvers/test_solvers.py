"""Solvers against round-to-nearest, judged on inputs they did not see."""

import pytest
import torch

from quantlab.errors import ConfigError, QuantizationError
from quantlab.formats import grouping
from quantlab.formats.layout import StorageLayout
from quantlab.solvers import InputStats, get_solver, list_solvers

IN, OUT = 320, 96
LAYOUTS = [
    StorageLayout.build("affine", 4, 64, IN, OUT, symmetric=False, scale_dtype=torch.float16),
    StorageLayout.build("affine", 3, 128, IN, OUT, symmetric=False, scale_dtype=torch.float16),
    StorageLayout.build("affine", 2, 64, IN, OUT, symmetric=False, scale_dtype=torch.float16),
    StorageLayout.build("affine", 4, 64, IN, OUT, symmetric=True, scale_dtype=torch.float16),
    StorageLayout("int8", 8, None, IN, OUT),
    StorageLayout.build("nf4", 4, 64, IN, OUT, double_quant=True),
    StorageLayout.build("nf4", 4, 64, IN, OUT, double_quant=False),
]


def _inputs(rows: int, seed: int) -> torch.Tensor:
    """Correlated activations with a few outlier channels, like a transformer's."""
    mixing = torch.Generator().manual_seed(0)
    A = torch.randn(IN, IN, generator=mixing) * 0.2 + torch.eye(IN)
    channel = torch.ones(IN)
    channel[:8] = 8.0
    return (torch.randn(rows, IN, generator=torch.Generator().manual_seed(seed)) @ A) * channel


@pytest.fixture(scope="module")
def problem():
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(2)) * 0.02
    stats = InputStats(IN)
    for chunk in _inputs(2048, seed=3).split(512):
        stats.add(chunk)
    return weight, stats, _inputs(1024, seed=4)


def _output_error(layout, solution, weight, held_out):
    quantized = layout.dequantize(layout.store(solution.codes, solution.params))
    return (held_out @ (weight - quantized).T).square().mean().item()


def _weight_error(layout, solution, weight):
    return (layout.dequantize(layout.store(solution.codes, solution.params)) - weight).square().mean().item()


def test_builtin_solvers_are_registered():
    assert {"rtn", "mse", "gptq"} <= set(list_solvers())


def test_unknown_solver_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"known solvers: .*gptq"):
        get_solver("optq")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lt: f"{lt.codec}{lt.bits}g{lt.group_size}")
def test_data_free_mse_lowers_the_weight_error(problem, layout):
    weight, _, _ = problem
    rtn = get_solver("rtn").solve(weight, layout, None, {})
    mse = get_solver("mse").solve(weight, layout, None, {})
    assert _weight_error(layout, mse, weight) < _weight_error(layout, rtn, weight) * (
        0.999 if layout.bits > 4 else 0.97
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lt: f"{lt.codec}{lt.bits}g{lt.group_size}")
@pytest.mark.parametrize("options", [{}, {"act_order": False}], ids=["act-order", "in-order"])
def test_gptq_lowers_the_output_error_on_unseen_inputs(problem, layout, options):
    weight, stats, held_out = problem
    rtn = _output_error(layout, get_solver("rtn").solve(weight, layout, None, {}), weight, held_out)
    gptq = _output_error(layout, get_solver("gptq").solve(weight, layout, stats, options), weight, held_out)
    assert gptq < 0.7 * rtn


def test_gptq_codes_land_in_the_normal_layout(problem):
    """Act order permutes columns while solving; the stored codes are in the layer's own order."""
    weight, stats, _ = problem
    layout = LAYOUTS[0]
    solution = get_solver("gptq").solve(weight, layout, stats, {"act_order": True})
    stored = layout.store(solution.codes, solution.params)
    codes, params = layout.load(stored)
    assert torch.equal(codes, solution.codes)
    # Each weight decodes near itself: a permuted layout would put codes in other columns.
    assert (layout.dequantize(stored) - weight).abs().max() < 4 * params.scale.max()


@pytest.mark.parametrize(("layout", "expected"), [(LAYOUTS[4], "minmax"), (LAYOUTS[0], "mse"), (LAYOUTS[5], "mse")])
def test_gptq_grid_by_width_min_max_at_8_bits_clipping_search_below(problem, layout, expected):
    weight, stats, _ = problem
    gptq = get_solver("gptq")
    default = gptq.solve(weight, layout, stats, {})
    chosen = gptq.solve(weight, layout, stats, {"grid": expected})
    other = gptq.solve(weight, layout, stats, {"grid": "mse" if expected == "minmax" else "minmax"})
    assert torch.equal(default.codes, chosen.codes) and torch.equal(default.params.scale, chosen.params.scale)
    assert not torch.equal(default.params.scale, other.params.scale)  # the two grids differ on this problem


def test_gptq_needs_calibration():
    with pytest.raises(QuantizationError, match="calibration"):
        get_solver("gptq").solve(torch.randn(8, 64), StorageLayout("int8", 8, None, 64, 8), None, {})


def test_gptq_refuses_a_hessian_that_dampening_cannot_fix():
    stats = InputStats(64)
    stats.hessian.fill_(float("nan"))
    with pytest.raises(QuantizationError, match="singular"):
        get_solver("gptq").solve(torch.randn(8, 64), StorageLayout("int8", 8, None, 64, 8), stats, {})


def test_gptq_rounds_dead_input_channels_as_they_stand():
    """A channel never active in calibration takes no error from the others: its codes are the nearest
    points of the grid GPTQ chose (which may clip it: the mse grid search gives it no weight)."""
    generator = torch.Generator().manual_seed(0)
    stats = InputStats(64)
    inputs = torch.randn(256, 64, generator=generator)
    inputs[:, 10:20] = 0
    stats.add(inputs)
    weight = torch.randn(8, 64, generator=generator)
    layout = StorageLayout.build("affine", 4, None, 64, 8, symmetric=False, scale_dtype=torch.float16)
    solution = get_solver("gptq").solve(weight, layout, stats, {})
    codes = grouping.ungroup(solution.codes, 64)
    scale, zero = solution.params.scale[:, 0], solution.params.zero[:, 0]
    assert torch.isfinite(layout.dequantize(layout.store(solution.codes, solution.params))).all()
    for column in range(10, 20):
        assert torch.equal(codes[:, column], layout.encode(weight[:, column], scale, zero)), column
    live = [column for column in range(64) if not 10 <= column < 20]
    assert not all(torch.equal(codes[:, c], layout.encode(weight[:, c], scale, zero)) for c in live)


@pytest.mark.parametrize(
    ("solver", "options", "message"),
    [
        ("gptq", {"damp": 0}, "damp"),
        ("gptq", {"act_order": "yes"}, "act_order"),
        ("gptq", {"act_order": True, "static_groups": False}, "static_groups"),
        ("gptq", {"blocksize": 64}, "unknown option"),
        ("mse", {"min_clip": 1.5}, "min_clip"),
    ],
)
def test_bad_solver_options_are_named(problem, solver, options, message):
    weight, stats, _ = problem
    with pytest.raises(ConfigError, match=message):
        get_solver(solver).solve(weight, LAYOUTS[0], stats, options)
