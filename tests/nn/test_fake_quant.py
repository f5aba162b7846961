"""The fake quantizer: it starts exactly at a solver's solution, computes exactly what it stores, and
passes gradients straight through the rounding (none to weights clipped by the grid)."""

import contextlib
import dataclasses

import pytest
import torch

from quantlab.formats.layout import StorageLayout
from quantlab.nn.fake_quant import SCALE_RANGE, FakeQuantizedWeight, FakeQuantLinear
from quantlab.solvers import InputStats, get_solver

IN, OUT = 160, 24  # 160 = 2.5 groups of 64: the last group is padded
LAYOUTS = [
    StorageLayout.build("affine", bits, 64, IN, OUT, symmetric=symmetric, scale_dtype=torch.float16)
    for bits in (2, 3, 4)
    for symmetric in (True, False)
] + [
    StorageLayout("int8", 8, None, IN, OUT),
    StorageLayout.build("nf4", 4, 64, IN, OUT, double_quant=True),
    StorageLayout.build("nf4", 4, 64, IN, OUT, double_quant=False),
]


def _ids(layout: StorageLayout) -> str:
    options = dataclasses.asdict(layout.options)
    asym = "" if options.get("symmetric", True) else "-asym"
    return f"{layout.codec}{layout.bits}{asym}{'-dq' if options.get('double_quant') else ''}"


@pytest.fixture(scope="module")
def problem():
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)) * 0.02
    stats = InputStats(IN)
    stats.add(torch.randn(512, IN, generator=torch.Generator().manual_seed(1)))
    return weight, stats


def _start(layout, problem):
    weight, stats = problem
    solution = get_solver("gptq").solve(weight, layout, stats, {})
    return solution, FakeQuantizedWeight(layout, weight, solution.codes, solution.params)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_it_starts_at_the_solvers_solution(layout, problem):
    solution, quantizer = _start(layout, problem)
    stored = layout.store(solution.codes, solution.params)
    assert torch.equal(quantizer(), layout.dequantize(stored))
    codes, _ = quantizer.solution()
    assert torch.equal(codes, solution.codes)
    for name, tensor in quantizer.stored().items():
        assert torch.equal(tensor, stored[name]), name


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_what_it_computes_is_what_it_stores(layout, problem):
    _, quantizer = _start(layout, problem)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        quantizer.offset.copy_(torch.rand(quantizer.offset.shape, generator=generator) * 2 - 1)
        quantizer.scale_ratio.copy_(0.7 + 0.6 * torch.rand(quantizer.scale_ratio.shape, generator=generator))
        if quantizer.zero is not None:
            quantizer.zero.add_(torch.randn(quantizer.zero.shape, generator=generator))
    computed = quantizer()
    assert torch.equal(computed, layout.dequantize(quantizer.stored()))
    computed.square().sum().backward()
    assert quantizer.offset.grad.abs().sum() > 0 and quantizer.scale_ratio.grad.abs().sum() > 0
    if quantizer.zero is not None:
        assert quantizer.zero.grad.abs().sum() > 0


def test_clipped_weights_get_no_gradient_and_the_scale_learns_the_clipping(problem):
    layout = StorageLayout.build("affine", 3, 64, IN, OUT, symmetric=True, scale_dtype=torch.float16)
    _, quantizer = _start(layout, problem)
    with torch.no_grad():
        quantizer.offset[0, 0, 0] = 100.0  # far beyond the grid's largest code
    quantizer().sum().backward()
    assert quantizer.offset.grad[0, 0, 0] == 0
    assert quantizer.offset.grad[0, 0, 1] != 0
    assert quantizer.scale_ratio.grad[0, 0] != 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_a_layer_started_from_its_stored_tensors_stores_them_again(layout, problem):
    solution, _ = _start(layout, problem)
    stored = layout.store(solution.codes, solution.params)
    quantizer = FakeQuantizedWeight.from_solution(layout, problem[0], stored)
    again = quantizer.stored()
    assert again.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(again[name], tensor), name


def test_projection_keeps_offsets_and_scales_in_range(problem):
    _, quantizer = _start(LAYOUTS[0], problem)
    with torch.no_grad():
        quantizer.offset.fill_(3.0)
        quantizer.scale_ratio.fill_(9.0)
    quantizer.project()
    assert quantizer.offset.max() == 0.5 and quantizer.scale_ratio.max() == SCALE_RANGE[1]
    unbounded = FakeQuantizedWeight(LAYOUTS[0], *problem_solution(problem), max_offset=None)
    with torch.no_grad():
        unbounded.offset.fill_(3.0)
    unbounded.project()
    assert unbounded.offset.max() == 3.0


def problem_solution(problem):
    weight, stats = problem
    solution = get_solver("gptq").solve(weight, LAYOUTS[0], stats, {})
    return weight, solution.codes, solution.params


def test_a_snapshot_restores_the_trained_numbers(problem):
    _, quantizer = _start(LAYOUTS[1], problem)
    snapshot = quantizer.snapshot()
    before = quantizer()
    with torch.no_grad():
        quantizer.offset.add_(0.4)
        quantizer.zero.add_(0.3)
    assert not torch.equal(quantizer(), before)
    quantizer.restore(snapshot)
    assert torch.equal(quantizer(), before)


def test_codes_of_a_wider_grid_are_refused(problem):
    weight, stats = problem
    wide = StorageLayout.build("affine", 4, 64, IN, OUT, symmetric=True, scale_dtype=torch.float16)
    solution = get_solver("gptq").solve(weight, wide, stats, {})
    with pytest.raises(ValueError, match="beyond this layout's 4 grid levels"):
        FakeQuantizedWeight(LAYOUTS[0], weight, solution.codes, solution.params)


def test_the_linear_layer_computes_with_the_fake_quantized_weight(problem):
    _, quantizer = _start(LAYOUTS[1], problem)  # 2-bit with zero points
    bias = torch.randn(OUT)
    layer = FakeQuantLinear(quantizer, bias)
    x = torch.randn(5, IN)
    torch.testing.assert_close(layer(x), x @ quantizer().T + bias)
    assert [name for name, p in layer.named_parameters() if p.requires_grad] == [
        "weight_quantizer.offset",
        "weight_quantizer.scale_ratio",
        "weight_quantizer.zero",
    ]


def _written_out(quantizer: FakeQuantizedWeight) -> torch.Tensor:
    """The straight-through weight as the chain of detached expressions LSQ writes: the reference
    the one-pass autograd function must match."""
    params = quantizer.grid()
    scale = params.scale.unsqueeze(-1)
    stored_zero = None if params.zero is None else params.zero.unsqueeze(-1)
    latent = quantizer.latent()
    with torch.no_grad():
        codes = quantizer.layout.encode(latent, scale, stored_zero)
        hard = quantizer.layout.decode(codes, scale, stored_zero)
    learned_scale = quantizer.start_scale.unsqueeze(-1) * quantizer.scale_ratio.unsqueeze(-1)
    scale = learned_scale + (scale - learned_scale).detach()
    if quantizer.zero is None:
        zero = quantizer.layout.constant_zero
    else:
        zero = quantizer.zero.unsqueeze(-1)
        zero = zero + (stored_zero - zero).detach()
    t = latent / scale + zero
    clipped = t.clamp(quantizer.levels[0], quantizer.levels[-1])
    soft = scale * (clipped + (quantizer.levels[codes.long()] - clipped).detach() - zero)
    return hard + (soft - soft.detach())


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_one_pass_gradients_equal_the_written_out_straight_through_estimator(layout, problem):
    _, quantizer = _start(layout, problem)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        quantizer.offset.copy_(torch.rand(quantizer.offset.shape, generator=generator) * 6 - 3)  # some clipped
        quantizer.scale_ratio.copy_(0.7 + 0.6 * torch.rand(quantizer.scale_ratio.shape, generator=generator))
    upstream = torch.randn(OUT, IN, generator=generator)
    gradients = []
    for weight in (lambda: quantizer(), lambda: _ungroup(_written_out(quantizer))):
        quantizer.zero_grad(set_to_none=True)
        computed = weight()
        (computed * upstream).sum().backward()
        gradients.append({name: p.grad.clone() for name, p in quantizer.named_parameters() if p.grad is not None})
        assert torch.equal(computed.detach(), layout.dequantize(quantizer.stored()))
    assert gradients[0].keys() == gradients[1].keys() and "offset" in gradients[0]
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradient, gradients[1][name], rtol=1e-4, atol=1e-6, msg=name)


def _ungroup(grouped: torch.Tensor) -> torch.Tensor:
    from quantlab.formats import grouping

    return grouping.ungroup(grouped, IN)


def test_weights_computed_once_runs_the_quantizer_once_and_gives_the_same_gradients(problem):
    """Several forwards in one step share one fake weight; the summed loss's gradients equal those of the
    forwards each backpropagated on its own."""
    from quantlab.nn.fake_quant import weights_computed_once

    layout = LAYOUTS[2]
    batches = [torch.randn(3, IN, generator=torch.Generator().manual_seed(seed)) for seed in (5, 6, 7)]
    gradients = []
    for shared in (False, True):
        _, quantizer = _start(layout, problem)
        layer = FakeQuantLinear(quantizer, None)
        calls = []
        quantizer.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        with weights_computed_once(layer) if shared else contextlib.nullcontext():
            losses = [layer(x).square().sum() for x in batches]
            if shared:
                sum(losses).backward()
        if not shared:
            for loss in losses:
                loss.backward()
        assert len(calls) == (1 if shared else len(batches)) and layer.shared_weight is None
        gradients.append([p.grad.clone() for p in quantizer.parameters() if p.requires_grad])
    for separate, together in zip(*gradients, strict=True):
        torch.testing.assert_close(together, separate)
