"""GPTQ's memory bounds for wide layers (statistics by column panels, the float32 mean made a slice at a time,
the factor rounded inside its own float64 buffer, grid searches by rows, the later columns updated by slices,
grids looked up per group, statistics released after their last layer) leave every code as the plain
computation chooses it."""

import pytest
import torch

import quantlab
from quantlab.calibration import collect_input_stats
from quantlab.calibration.blocks import find_blocks, first_block_inputs
from quantlab.calibration.sequential import selected_linears
from quantlab.calibration.solving import quantize_layers
from quantlab.formats import grouping
from quantlab.formats.layout import StorageLayout
from quantlab.methods.custom_bits import CustomBitsLinear
from quantlab.solvers import InputStats, get_solver, gptq, mse
from quantlab.solvers.gptq import _Grids
from quantlab.testing.models import tiny_llama
from quantlab.utils.threads import single_thread

IN, OUT = 200, 48
LAYOUTS = {
    "affine4-g64-padded": StorageLayout.build("affine", 4, 64, IN, OUT, symmetric=False, scale_dtype=torch.float16),
    "affine3-g32-sym": StorageLayout.build("affine", 3, 32, IN, OUT, symmetric=True, scale_dtype=torch.float16),
    "int8": StorageLayout("int8", 8, None, IN, OUT),
    "nf4-double-quant": StorageLayout.build("nf4", 4, 40, IN, OUT, double_quant=True),
}


def _stats(rows: int = 1024, seed: int = 0) -> InputStats:
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(IN, IN, generator=generator) * 0.3 + torch.eye(IN)
    inputs = torch.randn(rows, IN, generator=generator) @ mixing * torch.rand(IN, generator=generator) * 3
    inputs[:, 5] = 0  # a dead input channel
    stats = InputStats(IN)
    for chunk in inputs.split(256):
        stats.add(chunk)
    return stats


def _plain_gptq(weight: torch.Tensor, layout: StorageLayout, stats: InputStats, act_order: bool, grid: str):
    """GPTQ as written before the memory bounds: separate float64 matrices, a float32 copy of the factor,
    cloned weights, every step on one thread."""
    with single_thread():
        W = weight.float().clone()
        hessian = stats.hessian
        diagonal = hessian.diagonal().double()
        dead = diagonal == 0
        diagonal[dead] = 1.0
        order = torch.argsort(diagonal, descending=True) if act_order else torch.arange(IN)
        grids = _Grids(layout, W, order, True, stats.channel_weights() if grid == "mse" else None)
        permuted = hessian.double()[order][:, order]
        permuted.diagonal()[dead[order]] = 1.0
        permuted.diagonal().add_(0.01 * permuted.diagonal().mean())
        inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(permuted)), upper=True).float()
        columns = W[:, order].T.contiguous()
        codes = torch.empty(columns.shape, dtype=torch.uint8)
        for start in range(0, IN, 128):
            end = min(start + 128, IN)
            block = columns[start:end].clone()
            errors = torch.empty_like(block)
            for i in range(end - start):
                scale, zero = grids.at(start + i, block[i:], columns[end:])
                q = layout.encode(block[i], scale, zero)
                codes[start + i] = q
                error = (block[i] - layout.decode(q, scale, zero)) / inverse[start + i, start + i]
                block[i:].addr_(inverse[start + i, start + i : end], error, alpha=-1)
                errors[i] = error
            columns[end:].sub_(inverse[start:end, end:].T @ errors)
        unpermuted = torch.empty_like(codes.T)
        unpermuted[:, order] = codes.T
        return grouping.group(unpermuted, layout.group_size), grids.collected()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("grid", ["mse", "minmax"])
def test_codes_and_grids_are_those_of_the_plain_computation(name, act_order, grid, monkeypatch):
    layout = LAYOUTS[name]
    if layout.fits_groups_together and not act_order:
        pytest.skip("double quantization always fits its grids up front: the act-order case covers it")
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)) * 0.02
    stats = _stats()
    expected_codes, expected_params = _plain_gptq(weight, layout, stats, act_order, grid)
    monkeypatch.setattr(mse, "SEARCH_WEIGHTS", 3 * IN)  # the grid search three rows at a time
    monkeypatch.setattr(gptq, "UPDATE_ROWS", 24)  # the later columns' update in slices of 24
    options = {"act_order": act_order, "grid": grid, **({} if act_order else {"static_groups": True})}
    solution = get_solver("gptq").solve(weight, layout, stats, options)
    assert torch.equal(solution.codes, expected_codes)
    assert torch.equal(solution.params.scale, expected_params.scale)
    assert (solution.params.zero is None) == (expected_params.zero is None)
    if expected_params.zero is not None:
        assert torch.equal(solution.params.zero, expected_params.zero)


def test_the_grid_search_by_rows_finds_the_grids_of_the_whole_search(monkeypatch):
    layout = LAYOUTS["affine4-g64-padded"]
    grouped = grouping.group(torch.randn(OUT, IN, generator=torch.Generator().manual_seed(2)), layout.group_size)
    importance = mse.column_importance(layout, _stats().channel_weights())
    whole = mse.search_grid(grouped, layout, importance)
    monkeypatch.setattr(mse, "SEARCH_WEIGHTS", 5 * IN)
    by_rows = mse.search_grid(grouped, layout, importance)
    assert torch.equal(by_rows.scale, whole.scale) and torch.equal(by_rows.zero, whole.zero)


def test_statistics_by_column_panels_are_the_whole_product(monkeypatch):
    whole = _stats()
    monkeypatch.setattr(InputStats, "PRODUCT_COLUMNS", 48)  # four panels, the last narrower
    panels = _stats()
    scale = whole.hessian.abs().max().item()  # float32 rounding of each product, not a different sum
    torch.testing.assert_close(panels.hessian, whole.hessian, rtol=1e-5, atol=1e-6 * scale)
    assert panels.count == whole.count


def test_the_float32_mean_is_the_float64_sum_divided_then_rounded():
    stats = _stats()
    expected = (stats.gram / stats.count).float()
    stats.all_reduce()
    assert stats.gram is None
    assert torch.equal(stats.hessian, expected)


def test_each_statistics_is_released_after_the_last_layer_solved_from_it():
    model = tiny_llama()
    _, blocks = find_blocks(model)
    batches = first_block_inputs(model, blocks[0], torch.randint(0, 256, (8, 32)), batch_size=4)
    names = selected_linears(blocks[0], "model.layers.0", lambda name: True)
    stats = collect_input_stats(blocks[0], names, batches)
    config = quantlab.CustomBitsConfig(bits=4, group_size=32, solver="gptq")
    quantized = quantize_layers(blocks[0], names, config, CustomBitsLinear, stats)
    assert set(quantized) == set(names)
    for relative in names:
        with pytest.raises(RuntimeError, match="released"):
            stats[relative].channel_weights()


def test_each_input_builds_its_statistics_once(monkeypatch):
    """One `in x in` matrix per distinct input for the whole pass, not one per batch."""
    model = tiny_llama()
    _, blocks = find_blocks(model)
    batches = first_block_inputs(model, blocks[0], torch.randint(0, 256, (8, 32)), batch_size=2)
    names = selected_linears(blocks[0], "model.layers.0", lambda name: True)
    built = []
    original = InputStats.__init__

    def counted(self, in_features):
        built.append(in_features)
        original(self, in_features)

    monkeypatch.setattr(InputStats, "__init__", counted)
    stats = collect_input_stats(blocks[0], names, batches)
    assert len(batches) == 4
    assert len(built) == len({id(value) for value in stats.values()}) == 4  # q/k/v, o, gate/up, down
