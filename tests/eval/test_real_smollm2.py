"""Perplexity bounds of the built-in methods on the real SmolLM2-135M (slow: a minute or so per perplexity).

The text is the bundled WikiText-2 head: its first 16 x 512 tokens are those of the full file
(tests/assets checks it), so these are the harness's evaluation windows (benchmarks/RESULTS.md).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantlab
from quantlab.assets.models import smollm2_dir
from quantlab.assets.text import bundled_text
from quantlab.eval import perplexity
from quantlab.eval.size import checkpoint_bits_per_weight

pytestmark = pytest.mark.slow

CONFIGS = {
    "int8": quantlab.Int8SymmetricConfig(),
    "nf4_double_quant": quantlab.NF4Config(blocksize=64, double_quant=True),
    "nf4": quantlab.NF4Config(blocksize=64, double_quant=False),
    "custom_bits_4_g64_asym": quantlab.CustomBitsConfig(bits=4, group_size=64, symmetric=False),
    "custom_bits_3_g128_sym": quantlab.CustomBitsConfig(bits=3, group_size=128, symmetric=True),
}
# Upper bounds: at most about fp32 for int8, bitsandbytes' NF4+DQ for nf4, round to nearest 4-bit g64 for custom bits
# (their reference figures are in benchmarks/RESULTS.md).
PERPLEXITY_LIMITS = {"int8": 36.12, "nf4_double_quant": 45.84, "custom_bits_4_g64_asym": 52.75}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Quantize on load (the real path) and save each method once; tests share the results."""
    cache: dict[str, tuple[torch.nn.Module, str]] = {}

    def get(name: str) -> tuple[torch.nn.Module, str]:
        if name not in cache:
            model = AutoModelForCausalLM.from_pretrained(
                smollm2_dir(), dtype=torch.float32, quantization_config=CONFIGS[name], local_files_only=True
            ).eval()
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            cache[name] = (model, str(directory))
        return cache[name]

    yield get
    cache.clear()


@pytest.mark.parametrize("name", sorted(PERPLEXITY_LIMITS))
def test_perplexity_within_its_bound(saved, tokenizer, name):
    model, _ = saved(name)
    assert perplexity(model, tokenizer, bundled_text()) <= PERPLEXITY_LIMITS[name]


def test_nf4_double_quant_stores_at_most_4_13_bits_per_weight(saved):
    _, directory = saved("nf4_double_quant")
    assert checkpoint_bits_per_weight(directory) <= 4.13


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reload_gives_bit_identical_logits(saved, tokenizer, name):
    model, directory = saved(name)
    ids = tokenizer(bundled_text()[:2000], return_tensors="pt")["input_ids"][:, :128]
    reloaded = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    assert type(reloaded.config.quantization_config) is type(CONFIGS[name])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
