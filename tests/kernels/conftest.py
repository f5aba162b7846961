"""Fixtures for the kernel tests: the native library, and each instruction set this CPU has."""

import pytest

from quantlab.kernels.cpu import native, ops

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


INT8_KERNELS = {"avx2": 1, "avx512_vnni": 2}  # the instruction set each int8-activation kernel runs at


@pytest.fixture(scope="module", params=list(INT8_KERNELS))
def operators(request):
    """The torch operators, with the kernels held to one int8-activation kernel's instruction set."""
    lib = native.library()
    if not ops.available() or lib is None:
        pytest.skip("quantlab's torch operators could not be built here (no C/C++ compiler?)")
    if INT8_KERNELS[request.param] > lib.ql_isa():
        pytest.skip(f"this CPU has no {request.param.split('_')[0]}")
    lib.ql_force_isa(INT8_KERNELS[request.param])
    try:
        if not native.int8_activations_supported():
            pytest.skip(f"this CPU has no {request.param}")
        yield ops
    finally:
        lib.ql_force_isa(-1)
