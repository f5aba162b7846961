"""Native quantize ops against the codecs' torch definitions in quantlab.formats, bit for bit.

A codec's round to nearest (`StorageLayout.quantize`) runs the op the quantize-op table
(`quantlab.formats.fast_path`) holds for the tensor's device and falls back to its definition.
"""

import pytest
import torch

from quantlab.formats import fast_path, grouping, nf4, packing
from quantlab.formats.layout import StorageLayout
from quantlab.kernels import quantize_op
from quantlab.kernels.cpu import quantize as native_quantize

SCALE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def torch_path(monkeypatch, function, *args):
    """`function` with the native library switched off: the torch implementation."""
    with monkeypatch.context() as patch:
        patch.setenv("QUANTLAB_NATIVE_KERNELS", "0")
        return function(*args)


def weights(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Random weights with the cases that break naive code: constant, zero, huge, tiny rows and ties."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=generator) * 0.02
    w[0] = 0.0
    w[1] = 0.37
    w[2] *= 1e5  # float16 scales overflow to inf
    w[3] *= 1e-6  # float16 scales underflow to subnormals
    w[4] = torch.arange(in_features) % 16 * 0.125  # codes exactly on ties
    w[5, ::3] = -0.0
    return w


def assert_bits_equal(native: torch.Tensor, reference: torch.Tensor, zero_sign_may_differ: bool = False) -> None:
    assert native.dtype == reference.dtype and native.shape == reference.shape
    if zero_sign_may_differ:  # torch's amin returns +0 or -0 by position; the value is the same
        native, reference = native + 0.0, reference + 0.0
    assert torch.equal(native.contiguous().view(torch.uint8), reference.contiguous().view(torch.uint8))


def affine_layout(shape, bits, group_size, symmetric, scale_dtype) -> StorageLayout:
    return StorageLayout.build(
        "affine", bits, group_size, shape[1], shape[0], symmetric=symmetric, scale_dtype=scale_dtype
    )


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [False, True])
def test_affine_quantize_matches_torch(monkeypatch, isa, bits, symmetric):
    for seed, (shape, group_size) in enumerate([((16, 256), 64), ((9, 200), 32), ((7, 577), None), ((8, 300), 256)]):
        w = weights(*shape, seed)
        for scale_dtype in SCALE_DTYPES:
            layout = affine_layout(shape, bits, group_size, symmetric, scale_dtype)
            expected = torch_path(monkeypatch, layout.quantize, w)
            codes, scale, zero = native_quantize.affine_quantize(w, bits, group_size, symmetric, scale_dtype)
            assert_bits_equal(layout.codes(expected["weight"]), codes)
            assert_bits_equal(scale, expected["weight_scale"])
            assert (zero is None) == ("weight_zero" not in expected)
            if zero is not None:
                assert_bits_equal(zero, expected["weight_zero"], zero_sign_may_differ=True)


def assert_same_stored(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for name in expected:
        assert_bits_equal(actual[name], expected[name])


@pytest.mark.parametrize("blocksize", [16, 64, 128, 4096])
def test_nf4_codes_match_torch(monkeypatch, isa, blocksize):
    for seed, shape in enumerate([(16, 256), (9, 200), (7, 577)]):
        w = weights(*shape, seed)
        levels = nf4.levels()
        w[6, : len(levels) - 1] = (levels[:-1] + levels[1:]) / 2 * w[6].abs().max()  # exactly on midpoints
        for double_quant in (False, True):
            layout = StorageLayout.build("nf4", 4, blocksize, shape[1], shape[0], double_quant=double_quant)
            expected = torch_path(monkeypatch, layout.quantize, w)
            assert_same_stored(expected, layout.quantize(w))
            codes, absmax = native_quantize.nf4_quantize(w, blocksize, nf4.midpoints(levels))
            assert_bits_equal(layout.codes(expected["weight"]), codes)
            if not double_quant:
                assert_bits_equal(absmax, expected["weight_absmax"])


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_matches_torch(monkeypatch, library, bits):
    for shape in [(3, 64), (2, 5, 24), (4, 13), (1, 1)]:
        codes = torch.randint(0, 1 << bits, shape, dtype=torch.uint8)
        assert_bits_equal(native_quantize.pack(codes, bits), torch_path(monkeypatch, packing.pack, codes, bits))
        assert_bits_equal(fast_path.pack(codes, bits), packing.pack(codes, bits))


@pytest.mark.parametrize("codec", ["affine", "int8"])
def test_codecs_dispatch_to_native_and_fall_back(monkeypatch, library, codec):
    """With the library, a codec's round to nearest gives the native result; without, the torch one; the
    definition (fit, encode, store) gives the same bits."""
    w = weights(16, 256, 0)
    bits = 8 if codec == "int8" else 4
    options = {} if codec == "int8" else {"symmetric": False}
    layout = StorageLayout.build(codec, bits, 64, 256, 16, scale_dtype=torch.float16, **options)
    native = layout.quantize(w)
    assert_same_stored(torch_path(monkeypatch, layout.quantize, w), native)
    grouped = grouping.group(w, 64)
    params = layout.fit(grouped)
    assert_same_stored(layout.store(layout.quantize_grouped(grouped, params), params), native)


def test_native_ops_are_registered_for_cpu_only():
    for name in ("affine_quantize", "nf4_quantize", "pack", "bucketize", "count_nonfinite", "offset_to_signed"):
        assert quantize_op(name, "cpu") is getattr(native_quantize, name)
        assert quantize_op(name, "meta") is None


def test_formats_do_not_import_the_kernels():
    """`quantlab.formats` is pure torch: the kernels import it, never the other way round."""
    import ast
    from pathlib import Path

    import quantlab.formats

    for source in Path(quantlab.formats.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom | ast.Import):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(name.startswith("quantlab.kernels") for name in names), source.name


def test_dispatch_without_a_registered_op_runs_the_definition():
    """A device with no quantize ops (here: meta) takes the torch code, shapes and dtypes as native."""
    w = torch.randn(8, 64, device="meta")
    stored = StorageLayout("affine", 3, 32, 64, 8, scale_dtype=torch.float16).quantize(w)
    assert stored["weight"].shape == (8, 2, 12) and stored["weight_scale"].dtype == torch.float16


def test_count_nonfinite(library):
    w = torch.randn(37, 53)
    assert native_quantize.count_nonfinite(w) == 0
    w[3, 4], w[0, 0], w[36, 52] = float("nan"), float("inf"), float("-inf")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert native_quantize.count_nonfinite(w.to(dtype)) == 3
    assert native_quantize.count_nonfinite(w.t()) == 3
    assert native_quantize.count_nonfinite(torch.empty(0, 5)) == 0


def test_bucketize_matches_torch(library):
    boundaries = torch.tensor(sorted(nf4.dynamic_map()))  # has repeated zeros
    values = torch.cat([torch.randn(5000), boundaries, -boundaries, torch.tensor([-2.0, 2.0, 0.0, -0.0])])
    expected = torch.bucketize(values, boundaries, out_int32=True)
    assert torch.equal(native_quantize.bucketize(values, boundaries), expected)


def test_offset_to_signed(library):
    q = torch.arange(-127, 128, dtype=torch.int16)
    offset = (q + 128).to(torch.uint8)
    assert torch.equal(native_quantize.offset_to_signed(offset.clone()), q.to(torch.int8))
    assert torch.equal(native_quantize.offset_to_signed(offset.clone()), (offset.to(torch.int16) - 128).to(torch.int8))
    kept = offset.clone()
    assert torch.equal(fast_path.offset_to_signed(kept), q.to(torch.int8))
    assert torch.equal(kept, offset)  # the fast path converts its own copy
