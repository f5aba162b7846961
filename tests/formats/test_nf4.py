"""The nf4 codec: NormalFloat-4 codes with plain or double-quantized absmax."""

import pytest
import torch

from quantlab.formats import grouping, nf4
from quantlab.formats.layout import StorageLayout


def test_codes_equal_bitsandbytes():
    functional = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    weight = torch.randn(96, 256) * 0.02
    packed, _ = functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    flat = packed.reshape(-1)
    theirs = torch.stack([flat >> 4, flat & 15], dim=-1).reshape(96, 256)
    layout = StorageLayout.build("nf4", 4, 64, 256, 96, double_quant=True)
    ours = layout.codes(layout.quantize(weight)["weight"]).reshape(96, 256)
    assert torch.equal(ours, theirs)


def test_double_quant_absmax_is_close_to_float_and_keeps_the_codes():
    torch.manual_seed(0)
    weight = torch.randn(300, 512)
    plain_layout = StorageLayout("nf4", 4, 64, 512, 300)
    double_layout = StorageLayout.build("nf4", 4, 64, 512, 300, double_quant=True)
    plain, double = plain_layout.quantize(weight), double_layout.quantize(weight)
    assert torch.equal(double["weight"], plain["weight"])
    restored = double_layout.params(double).scale
    assert ((restored - plain["weight_absmax"]).abs() / plain["weight_absmax"]).max() < 0.02


def test_dynamic_map_matches_bitsandbytes():
    functional = pytest.importorskip("bitsandbytes.functional")
    assert torch.allclose(torch.tensor(nf4.dynamic_map()), functional.create_dynamic_map(signed=True))


@pytest.mark.parametrize("double_quant", [False, True])
def test_store_then_load_gives_back_codes_and_grids(double_quant, helpers):
    layout = StorageLayout.build("nf4", 4, 32, 100, 8, double_quant=double_quant)
    grouped = grouping.group(helpers.tricky_weights(8, 100) + 0.01, 32)
    helpers.assert_store_load_round_trip(layout, grouped)


@pytest.mark.parametrize("blocksize", [16, 64, 4096])
@pytest.mark.parametrize("double_quant", [False, True])
def test_round_to_nearest_is_bit_exact_with_the_native_fast_path(
    library, torch_quantize, blocksize, double_quant, helpers
):
    for seed, shape in enumerate([(16, 256), (9, 200)]):
        layout = StorageLayout.build("nf4", 4, blocksize, shape[1], shape[0], double_quant=double_quant)
        weight = helpers.tricky_weights(*shape, seed)
        helpers.assert_same_bits(layout.quantize(weight), torch_quantize(layout, weight))


def test_a_block_of_zeros_keeps_absmax_zero_and_decodes_to_zeros(torch_quantize):
    layout = StorageLayout("nf4", 4, 32, 64, 2)
    stored = torch_quantize(layout, torch.zeros(2, 64))
    assert torch.equal(stored["weight_absmax"], torch.zeros(2, 2))
    assert torch.equal(layout.dequantize(stored), torch.zeros(2, 64))


def test_constant_result_marks_as_torch_compiler_marks():
    """`constant_result` (on `dynamic_map`) sets what `torch.compiler.assume_constant_result` sets."""
    from quantlab.utils.compile_constants import constant_result

    def probe() -> int:
        return 0

    def ours() -> int:
        return 0

    assert torch.compiler.assume_constant_result(probe) is probe and constant_result(ours) is ours
    assert vars(probe) == vars(ours) == {"_dynamo_marked_constant": True}
    assert {name: value for name, value in vars(nf4.dynamic_map).items() if name.startswith("_dynamo")} == vars(probe)


def test_importing_quantlab_does_not_import_torch_dynamo():
    """Unless a package transformers imports does (hqq, the `peers` extra): hidden here."""
    import subprocess
    import sys

    code = (
        "import importlib.util, sys; find = importlib.util.find_spec; "
        "importlib.util.find_spec = lambda name, *rest: None if name.split('.')[0] == 'hqq' else find(name, *rest); "
        "import quantlab; print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
