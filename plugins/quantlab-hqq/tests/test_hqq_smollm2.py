"""HQQ on the real SmolLM2-135M, shared perplexity harness, against round-to-nearest side by side.

Measured (16 windows of 512 tokens, fp32 36.077): 4-bit g64 44.6 against custom bits
round-to-nearest 52.8; 3-bit g64 112 against 343. The bounds leave room for the noise of
other torch builds, not for a regression to round-to-nearest.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantlab import CustomBitsConfig
from quantlab.eval import perplexity
from quantlab.eval.data import bundled_text
from quantlab.eval.models import smollm2_dir
from quantlab_hqq import HqqConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    directory = smollm2_dir()
    return directory, AutoTokenizer.from_pretrained(directory, local_files_only=True)


@pytest.fixture(scope="module")
def text():
    return bundled_text()  # its first 16 x 512 SmolLM2 tokens are those of the full WikiText-2 test file


def quantized_perplexity(smollm2, text, config) -> float:
    directory, tokenizer = smollm2
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, quantization_config=config)
    return perplexity(model, tokenizer, text)


@pytest.mark.parametrize(("bits", "group_size", "bound"), [(4, 64, 47.0), (3, 64, 135.0)])
def test_beats_round_to_nearest_clearly(smollm2, text, bits, group_size, bound):
    hqq = quantized_perplexity(smollm2, text, HqqConfig(bits=bits, group_size=group_size))
    rtn = quantized_perplexity(smollm2, text, CustomBitsConfig(bits=bits, group_size=group_size))
    assert hqq <= bound, f"hqq {bits}-bit g{group_size}: perplexity {hqq:.3f} (round-to-nearest {rtn:.3f})"
    assert hqq < 0.92 * rtn, f"hqq {hqq:.3f} is not clearly below round-to-nearest {rtn:.3f}"
