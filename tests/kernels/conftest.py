"""Fixtures for the kernel tests: the native library, and each instruction set this CPU has."""

import pytest

from quantlab.kernels.cpu import native

ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}


@pytest.fixture(scope="session")
def library():
    lib = native.library()
    if lib is None:
        pytest.skip("the native CPU kernels could not be built here (no C compiler?)")
    return lib


@pytest.fixture(params=list(ISAS))
def isa(request, library):
    """Run a test once per instruction set the kernels have; skip those this CPU lacks."""
    if ISAS[request.param] > library.ql_isa():
        pytest.skip(f"this CPU has no {request.param}")
    library.ql_force_isa(ISAS[request.param])
    yield request.param
    library.ql_force_isa(-1)
