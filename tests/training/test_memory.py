"""Memory helpers: returning checkpoint pages a quantized model no longer uses, without touching live tensors."""

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantlab.methods.nf4 import NF4Config
from quantlab.testing import tiny_llama, tiny_model_dir
from quantlab.training.memory import current_memory_bytes, peak_memory_bytes, release_checkpoint_pages

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux")


@linux_only
def test_released_pages_leave_the_quantized_model_intact(tmp_path):
    folder = tiny_model_dir(tiny_llama(0), tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=NF4Config(), dtype=torch.float32)
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        expected = model(x).logits
    assert release_checkpoint_pages(model) > 0  # the float projections' pages
    with torch.no_grad():
        assert torch.equal(model(x).logits, expected)


@linux_only
def test_tensors_changed_in_place_keep_their_changes(tmp_path):
    """A float model's weights live in the map itself; edited in place they must survive a release."""
    folder = tiny_model_dir(tiny_llama(0), tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
        expected = {name: p.clone() for name, p in model.named_parameters()}
    release_checkpoint_pages(model)
    assert all(torch.equal(p, expected[name]) for name, p in model.named_parameters())


def test_memory_figures_are_plausible():
    assert peak_memory_bytes() >= current_memory_bytes() > 50 * 2**20
