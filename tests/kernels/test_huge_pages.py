"""Stored weights moved into one huge-page mapping: same values, separate tensors, savable, optional."""

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantlab
from quantlab.kernels.cpu import huge_pages
from quantlab.testing.models import tiny_llama

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")


def _layers() -> list[torch.nn.Module]:
    model = quantlab.quantize(tiny_llama(seed=2), quantlab.CustomBitsConfig(bits=4, group_size=32))
    return [m for m in model.modules() if hasattr(m, "stored_tensors")]


def test_moved_tensors_keep_values_dtypes_and_shapes_each_with_a_storage_of_its_own():
    layers = _layers()
    before = [{n: t.clone() for n, t in layer.stored_tensors().items()} for layer in layers]
    moved = huge_pages.move_to_huge_pages(layers)
    assert moved >= sum(layer.stored_bytes() for layer in layers)
    starts = set()
    for layer, old in zip(layers, before, strict=True):
        for name, tensor in layer.stored_tensors().items():
            assert tensor.dtype == old[name].dtype and torch.equal(tensor, old[name])
            storage = tensor.untyped_storage()
            assert storage.nbytes() == tensor.numel() * tensor.element_size()
            assert tensor.data_ptr() % huge_pages.ALIGNMENT == 0
            starts.add(storage.data_ptr())
    assert len(starts) == sum(len(layer.stored_tensors()) for layer in layers)
    first = next(iter(layers[0].stored_tensors().values()))
    assert first.data_ptr() % huge_pages.HUGE_PAGE == 0  # the mapping's first tensor starts a huge page


def test_a_moved_model_saves_and_loads_as_separate_tensors(tmp_path):
    layers = _layers()
    huge_pages.move_to_huge_pages(layers)
    state = {f"{i}.{n}": t for i, layer in enumerate(layers) for n, t in layer.stored_tensors().items()}
    save_file(state, tmp_path / "moved.safetensors")  # shared storages would be refused here
    loaded = load_file(tmp_path / "moved.safetensors")
    assert all(torch.equal(loaded[key], tensor) for key, tensor in state.items())


def test_a_parameter_keeps_its_object_and_takes_the_moved_data():
    layer = torch.nn.Module()
    layer.scale = torch.nn.Parameter(torch.randn(300), requires_grad=False)
    layer.stored_tensors = lambda: {"scale": layer.scale}
    parameter, values = layer.scale, layer.scale.detach().clone()
    old_pointer = parameter.data_ptr()
    huge_pages.move_to_huge_pages([layer])
    assert layer.scale is parameter and parameter.data_ptr() != old_pointer
    assert torch.equal(parameter, values)


def test_quantlab_huge_pages_0_leaves_every_tensor_where_it_is(monkeypatch):
    monkeypatch.setenv("QUANTLAB_HUGE_PAGES", "0")
    layers = _layers()
    pointers = [t.data_ptr() for layer in layers for t in layer.stored_tensors().values()]
    assert huge_pages.move_to_huge_pages(layers) == 0
    assert [t.data_ptr() for layer in layers for t in layer.stored_tensors().values()] == pointers


def test_a_tensor_two_modules_hold_moves_once_and_stays_shared():
    shared = torch.arange(5000, dtype=torch.int32)
    first, second = torch.nn.Module(), torch.nn.Module()
    for module in (first, second):
        module.register_buffer("codes", shared)
        module.stored_tensors = lambda module=module: {"codes": module.codes}
    moved = huge_pages.move_to_huge_pages([first, second])
    assert moved == -(-shared.numel() * 4 // huge_pages.ALIGNMENT) * huge_pages.ALIGNMENT
    assert first.codes is second.codes and torch.equal(first.codes, torch.arange(5000, dtype=torch.int32))
