"""GPTQ's inverse-Hessian factor, computed in place in one float64 buffer and rounded to float32 inside it,
equals the out-of-place computation."""

import pytest
import torch

from quantlab.errors import QuantizationError
from quantlab.solvers.gptq import _inverse_cholesky


def _reference(hessian: torch.Tensor, order: torch.Tensor, dead: torch.Tensor, damp: float) -> torch.Tensor:
    """The factor as separate calls compute it, each into a new matrix."""
    permuted = hessian.double()[order][:, order]
    permuted.diagonal()[dead] = 1.0
    dampened = permuted.clone()
    dampened.diagonal().add_(damp * permuted.diagonal().mean())
    factor = torch.linalg.cholesky(dampened)
    return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True).float()


@pytest.mark.parametrize("size", [7, 64, 300, 1100])
@pytest.mark.parametrize("dead_inputs", [0, 3])
def test_the_in_place_factor_is_the_out_of_place_one(size: int, dead_inputs: int) -> None:
    generator = torch.Generator().manual_seed(size)
    inputs = torch.randn(4 * size, size, generator=generator) * torch.rand(size, generator=generator)
    inputs[:, :dead_inputs] = 0
    hessian = inputs.T @ inputs / inputs.shape[0]
    diagonal = hessian.diagonal().double()
    dead = diagonal == 0
    diagonal[dead] = 1.0
    order = torch.argsort(diagonal, descending=True)
    got = _inverse_cholesky(hessian, order, dead[order], 0.01)
    expected = _reference(hessian, order, dead[order], 0.01)
    assert torch.equal(got, expected)
    assert got.stride() == expected.stride()  # the column sweep reads it in the same layout
    assert torch.equal(got, got.triu())
    assert got.untyped_storage().nbytes() == 8 * size * size  # no buffer beside the float64 one


def test_a_hessian_that_stays_singular_is_refused() -> None:
    hessian = torch.full((8, 8), float("nan"))
    with pytest.raises(QuantizationError, match="stays singular"):
        _inverse_cholesky(hessian, torch.arange(8), torch.zeros(8, dtype=torch.bool), 0.01)
