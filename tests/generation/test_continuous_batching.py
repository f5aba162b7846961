"""transformers' continuous batching (`generate_batch`, paged KV cache) runs quantlab's layers on CPU and
decodes every request as plain greedy `generate` does."""

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import quantlab
from quantlab.generation import compile_for_decoding
from quantlab.testing.models import tiny_llama

PROMPTS = [[5, 17, 42, 9], [7, 8, 200, 31, 64, 12], [1, 2, 3], [99, 98, 97, 96, 95, 94, 93, 92, 91]]


@pytest.mark.parametrize(
    ("config", "fast_path"),
    [
        (quantlab.CustomBitsConfig(bits=4, group_size=32), False),
        (quantlab.Int8SymmetricConfig(), False),
        (quantlab.CustomBitsConfig(bits=4, group_size=32), True),  # the model also set up for compiled decoding
    ],
)
def test_generate_batch_gives_each_prompt_its_greedy_tokens(config, fast_path):
    model = tiny_llama(seed=5)
    quantlab.quantize(model, config)
    if fast_path:
        compile_for_decoding(model, max_cache_len=32)
    generation = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64)
    outputs = model.generate_batch(PROMPTS, generation_config=generation, continuous_batching_config=batching)
    assert len(outputs) == len(PROMPTS)
    by_prompt = {tuple(output.prompt_ids): output.generated_tokens for output in outputs.values()}
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        options = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
        alone = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
        assert by_prompt[tuple(prompt)] == alone[0, len(prompt) :].tolist()
