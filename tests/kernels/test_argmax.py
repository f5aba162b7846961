"""`ql_argmax`: the index torch.argmax gives, at every instruction set the CPU has."""

import math

import pytest
import torch

from quantlab.kernels.cpu import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native CPU kernels are not built here")


def _rows() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    tied = torch.randn(1000)
    tied[[17, 500, 999]] = 9.0  # the first of equal maxima
    late_nan, early_nan = torch.randn(49152), torch.randn(77)
    late_nan[40000] = math.nan
    early_nan[[3, 60]] = math.nan
    return {
        "vocabulary": torch.randn(49152),
        "odd length": torch.randn(1001),
        "one": torch.tensor([-3.0]),
        "ties": tied,
        "all -inf": torch.full((35,), -math.inf),
        "max in the tail": torch.cat([torch.zeros(32), torch.tensor([0.0, 5.0, 1.0])]),
        "signed zeros": torch.tensor([-0.0, 0.0, -1.0]),
        "a NaN": late_nan,
        "two NaNs": early_nan,
    }


@pytest.mark.parametrize("isa", [0, 1, 2], ids=["portable", "avx2", "avx512"])
@pytest.mark.parametrize("name", list(_rows()))
def test_the_index_of_torch_argmax(isa, name):
    lib = native.library()
    if isa > lib.ql_isa():
        pytest.skip("this CPU lacks that instruction set")
    row = _rows()[name].contiguous()
    lib.ql_force_isa(isa)
    try:
        index = lib.ql_argmax(row.data_ptr(), row.numel())
    finally:
        lib.ql_force_isa(-1)
    assert index == torch.argmax(row).item()


def test_an_empty_row_has_no_index():
    assert native.library().ql_argmax(None, 0) == -1
