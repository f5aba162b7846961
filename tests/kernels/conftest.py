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


# each int8-activation kernel: the instruction set it runs at, and its many-row kernel (native.ROWS_*): the
# instruction set's, AMX tiles (where the CPU and Linux allow them), or the tiles emulated in C (any x86 CPU)
INT8_KERNELS = {
    "avx2": (1, native.ROWS_ISA),
    "avx512_vnni": (2, native.ROWS_ISA),
    "amx": (2, native.ROWS_AMX),
    "amx_emulated": (2, native.ROWS_AMX_EMULATED),
}


@pytest.fixture(scope="module", params=list(INT8_KERNELS))
def operators(request):
    """The torch operators, with the kernels held to one int8-activation kernel (instruction set, many-row kernel)."""
    lib = native.library()
    if not ops.available() or lib is None:
        pytest.skip("quantlab's torch operators could not be built here (no C/C++ compiler?)")
    isa, rows = INT8_KERNELS[request.param]
    if request.param == "amx_emulated":  # the emulated tiles run wherever int8 activations do
        isa = lib.ql_isa()
    if isa > lib.ql_isa():
        pytest.skip(f"this CPU has no {request.param.split('_')[0]}")
    if rows == native.ROWS_AMX and native.amx_status() != "ready":
        pytest.skip(f"AMX tiles do not run here: {native.amx_status()}")
    before = lib.ql_a8_rows_choice()
    lib.ql_force_isa(isa)
    try:
        if not native.int8_activations_supported():
            pytest.skip(f"this CPU has no {request.param}")
        assert lib.ql_set_a8_rows(rows) == 0
        yield ops
    finally:
        lib.ql_set_a8_rows(before)
        lib.ql_force_isa(-1)
