"""How quantlab keeps long-lived tensors out of the C allocator's heaps."""

import gc
import sys

import pytest
import torch

from quantlab.utils.allocator import OWN_MAPPING_BYTES, copy_to_own_mapping


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_tensor_is_copied_into_a_mapping_of_its_own(dtype):
    source = torch.randn(4, 256, 1024).to(dtype)
    copy = copy_to_own_mapping(source)
    assert torch.equal(copy, source) and copy.dtype == dtype and copy.shape == source.shape
    assert copy.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    assert copy.data_ptr() % 4096 == 0  # the start of a mapping, not a chunk of a heap


def test_small_tensors_and_tensors_autograd_tracks_stay_as_they_are():
    small = torch.ones(OWN_MAPPING_BYTES // 8)
    tracked = torch.ones(OWN_MAPPING_BYTES, requires_grad=True)
    assert copy_to_own_mapping(small) is small
    assert copy_to_own_mapping(tracked) is tracked


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_mapping_is_returned_when_the_last_view_is_gone():
    copy = copy_to_own_mapping(torch.ones(64, 1024, 1024))  # 256 MiB
    view = copy[1:3]
    del copy
    gc.collect()
    held = _resident_mib()
    del view
    gc.collect()
    assert held - _resident_mib() > 200
