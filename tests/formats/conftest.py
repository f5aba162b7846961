"""Fixtures for the codec tests: a codec's round to nearest without its native fast path, the native
library, and helpers handed out as a fixture (`helpers`): with `--import-mode=importlib` test modules
cannot import them."""

from types import SimpleNamespace

import pytest
import torch

from quantlab.formats.codec import GroupParams
from quantlab.formats.layout import StorageLayout
from quantlab.kernels.cpu import native


@pytest.fixture
def torch_quantize(monkeypatch):
    """`layout.quantize(weight)` with the native library switched off: the codec's definition."""

    def run(layout: StorageLayout, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        with monkeypatch.context() as patch:
            patch.setenv("QUANTLAB_NATIVE_KERNELS", "0")
            return layout.quantize(weight)

    return run


@pytest.fixture
def library():
    lib = native.library()
    if lib is None:
        pytest.skip("the native CPU kernels could not be built here (no C compiler?)")
    return lib


def assert_same_bits(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype and actual[name].shape == expected[name].shape, name
        assert torch.equal(actual[name].view(torch.uint8), expected[name].view(torch.uint8)), name


def assert_matches_specs(layout: StorageLayout, stored: dict[str, torch.Tensor]) -> None:
    assert {name: (tuple(t.shape), t.dtype) for name, t in stored.items()} == {
        name: (spec.shape, spec.dtype) for name, spec in layout.tensors.items()
    }


def assert_store_load_round_trip(layout: StorageLayout, grouped: torch.Tensor) -> tuple[GroupParams, GroupParams]:
    """Fit, encode, store and load `grouped` weights: the stored tensors match the layout's specs and load
    back to the same codes and scales. Returns (fitted, loaded) grids for codec-specific checks."""
    params = layout.fit(grouped)
    codes = layout.quantize_grouped(grouped, params)
    stored = layout.store(codes, params)
    assert_matches_specs(layout, stored)
    loaded_codes, loaded = layout.load(stored)
    assert torch.equal(loaded_codes, codes)
    assert torch.equal(loaded.scale, params.scale)
    return params, loaded


def tricky_weights(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Random weights plus rows that break naive code: zero, constant, tiny, and codes on ties."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=generator) * 0.02
    w[0] = 0.0
    w[1] = 0.37
    w[2] *= 1e-6
    w[3] = torch.arange(in_features) % 16 * 0.125
    return w


@pytest.fixture
def helpers() -> SimpleNamespace:
    return SimpleNamespace(
        assert_same_bits=assert_same_bits,
        assert_matches_specs=assert_matches_specs,
        assert_store_load_round_trip=assert_store_load_round_trip,
        tricky_weights=tricky_weights,
    )
