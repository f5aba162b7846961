"""The many-row int8-activation kernels (avx512_vnni_rows.c, avx2_int8_rows.c, amx_int8_rows.c: panels of
repacked codes, a prompt's prefill): each output equals the one-row kernel's on the same row (same int8
rounding of x, same exact int32 block dots; only the order of the float sums differs) and the rounded
activations times the dequantized weight. Row counts hit every remainder of the row tiles (6 rows VNNI, 4
AVX2, 32 AMX), feature counts every remainder of the panels (32 features VNNI and AMX, 16 AVX2). The AMX
kernel runs where the CPU and Linux allow its tiles, and everywhere with its tile instructions emulated
in C, which must give the VNNI kernel's outputs bit for bit."""

import pytest
import torch

import quantlab
from quantlab import CustomBitsConfig, Int8SymmetricConfig
from quantlab.kernels.cpu import native, ops

# the many-row kernels from 4 rows on; rests of 6-row tiles (VNNI): 4, 5, 2, 1, 5, 4, 3, 4; of 4-row tiles
# (AVX2): 0, 1, 0, 1, 3, 0, 1, 2; of 32-row steps (AMX, from 16 rows on): 23, 28, 1, 2
ROWS = [4, 5, 8, 13, 23, 28, 33, 34]
# panels of 32: 4 + 2, 1 + 18, 0 + 7, 0 + 21; of 16: 8 + 2, 3 + 2, 0 + 7, 1 + 5
FEATURES = (130, 50, 7, 21)


def layer(config, in_features: int, out_features: int) -> torch.nn.Module:
    torch.manual_seed(in_features + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    return quantlab.get_method(config.method).module_class.from_linear(linear, config)


def activations(rows: int, k: int = 576) -> torch.Tensor:
    return torch.randn(rows, k) * torch.linspace(0.1, 3.0, k)


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels round it: per block of 64 inputs, round(x * (127 / max|x|)) times max|x| / 127."""
    rows, k = x.shape
    blocks = torch.nn.functional.pad(x, (0, -k % 64)).view(rows, -1, 64)  # a last group cut short meets zeros
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse).double() * (amax / 127.0).double()).view(rows, -1)[:, :k]


def run(layers, x: torch.Tensor, activation_bits: int) -> torch.Tensor:
    with torch.no_grad():
        return ops.linear_group_op(x, *ops.group_arguments(layers), activation_bits)


def one_row_at_a_time(layers, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([run(layers, x[r : r + 1], 8) for r in range(x.shape[0])])


def assert_many_rows_match(layers, x: torch.Tensor, rounding_shows: bool = True) -> None:
    weight = torch.cat([module.dequantize_weight() for module in layers]).double()
    expected = rounded_activations(x) @ weight.T
    got = run(layers, x, 8)
    scale = expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= 2e-6 * scale
    one_row = one_row_at_a_time(layers, x)
    # float32 sums in another order: a few ulps of the largest output
    assert (got - one_row).abs().max().item() <= 1e-6 * scale
    if rounding_shows:  # the float kernels: measurably different, so int8 activations ran
        assert (run(layers, x, 0).double() - expected).abs().max().item() > 1e-4 * scale


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("symmetric", [False, True])
def test_4bit_many_rows_equal_one_row_and_the_reference(operators, rows, symmetric):
    config = CustomBitsConfig(bits=4, group_size=64, symmetric=symmetric)
    layers = [layer(config, 576, n) for n in FEATURES]
    assert_many_rows_match(layers, activations(rows, 576))


@pytest.mark.parametrize("scale_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("in_features", [640, 2112])  # 10 blocks; 33 groups of 64
def test_4bit_scale_dtypes_and_groups_at_many_rows(operators, scale_dtype, group_size, in_features):
    config = CustomBitsConfig(bits=4, group_size=group_size, scale_dtype=scale_dtype)
    layers = [layer(config, in_features, n) for n in (50, 21)]
    assert_many_rows_match(layers, activations(23, in_features))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group_size", [None, 64, 128])  # None: one group per row of 576 = 9 blocks
def test_int8_many_rows_equal_one_row_and_the_reference(operators, rows, group_size):
    layers = [layer(Int8SymmetricConfig(group_size=group_size), 576, n) for n in FEATURES]
    assert_many_rows_match(layers, activations(rows))


@pytest.mark.parametrize("config", [CustomBitsConfig(bits=4, group_size=64), Int8SymmetricConfig(group_size=64)])
def test_a_last_group_cut_short_at_many_rows(operators, config):
    """600 inputs in groups of 64: the last group holds 24 inputs, x is copied with zeros after them."""
    layers = [layer(config, 600, n) for n in (50, 21)]
    assert_many_rows_match(layers, activations(13, 600))


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
def test_int8_scale_dtypes_at_many_rows(operators, scale_dtype):
    layers = [layer(Int8SymmetricConfig(group_size=64, scale_dtype=scale_dtype), 640, n) for n in (50, 21)]
    assert_many_rows_match(layers, activations(13, 640))


def test_the_many_row_kernel_takes_the_extreme_codes_and_activations(operators):
    """Codes -128..127 against x at +-max|x| on 12 rows: the int8 offset (VNNI) and the sign trick's pairs
    (AVX2, at most 2 * 128 * 127) are exact."""
    module = layer(Int8SymmetricConfig(group_size=64), 128, 24)
    codes = torch.arange(-128, 128, dtype=torch.int8).repeat(12).view(24, 2, 64)
    module.weight.copy_(codes)
    x = torch.where(torch.arange(128) % 3 == 0, 1.0, -1.0).repeat(12, 1)
    x *= torch.linspace(0.5, 2.0, 12)[:, None]
    x[1::2] *= -1
    assert_many_rows_match([module], x, rounding_shows=False)


def test_4bit_extreme_codes_and_activations_at_many_rows(operators):
    """Codes 15 against x at +127 everywhere: 8 int16 steps of AVX2 sum to 8 * 3810, below 32767."""
    module = layer(CustomBitsConfig(bits=4, group_size=64, symmetric=True), 256, 16)
    packed = torch.full_like(module.weight, 0xFF) if module.weight.dtype == torch.uint8 else None
    assert packed is not None, module.weight.dtype
    module.weight.copy_(packed)
    x = torch.ones(9, 256)
    x[::2] = -1.0
    assert_many_rows_match([module], x, rounding_shows=False)


@pytest.fixture()
def vnni_rows(library):
    """The AVX512-VNNI kernel's instruction set; the test chooses the many-row kernel itself."""
    if library.ql_isa() < 2:
        pytest.skip("this CPU has no AVX-512")
    before = library.ql_a8_rows_choice()
    library.ql_force_isa(2)
    try:
        if not native.int8_activations_supported() or not ops.available():
            pytest.skip("this CPU has no AVX512-VNNI, or the torch operators could not be built")
        yield library
    finally:
        library.ql_set_a8_rows(before)
        library.ql_force_isa(-1)


@pytest.mark.parametrize("config", [CustomBitsConfig(bits=4, group_size=64), CustomBitsConfig(bits=4, group_size=128),
                                    Int8SymmetricConfig(group_size=None)])  # fmt: skip
@pytest.mark.parametrize("rows", [16, 37, 64])
def test_the_tiles_give_the_vnni_kernels_outputs_bit_for_bit(vnni_rows, config, rows):
    """amx_rows_body.h's step on the emulated tiles (and on the real ones where they run) against
    avx512_vnni_rows.c: the same int32 block dots and the same float epilogue in the same order."""
    layers = [layer(config, 640, n) for n in (70, 21)]
    x = activations(rows, 640)
    assert vnni_rows.ql_set_a8_rows(native.ROWS_ISA) == 0
    expected = run(layers, x, 8)
    choices = [native.ROWS_AMX_EMULATED] + ([native.ROWS_AMX] if native.amx_status() == "ready" else [])
    for choice in choices:
        assert vnni_rows.ql_set_a8_rows(choice) == 0
        assert torch.equal(run(layers, x, 8), expected), choice


def test_the_amx_check_and_status_agree_with_the_machine(library):
    """`ql_amx_check` runs (and passes) exactly where the tiles are ready; the kernel cannot be turned on elsewhere."""
    status = native.amx_status()
    if status == "ready" and library.ql_isa() == 2:
        assert library.ql_amx_check() == 0
        assert library.ql_amx_speedup() > 0
    else:
        assert library.ql_amx_check() == -1
        assert library.ql_amx_speedup() == -1
        assert library.ql_set_a8_rows(native.ROWS_AMX) == 1
        assert library.ql_a8_rows_choice() != native.ROWS_AMX


def test_the_amx_check_runs_in_a_child_process_first(library):
    """A fault in the tiles must end a child, not the process loading the kernels: the child's verdict is the
    library's (0 where the tiles run and agree; -1, exit code 255, where they cannot run)."""
    ready = native.amx_status() == "ready" and library.ql_isa() == 2
    assert native._amx_check_in_child(library) == (0 if ready else 255)
