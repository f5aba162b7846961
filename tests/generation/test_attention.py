"""The compiled step's attention: transformers' SDPA attention's values, one-token grouped-query steps of
marked layers computed on the key/value heads (by `quantlab::attention` where the native kernels are
built), everything else handed to transformers."""

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from quantlab.generation import attention as attention_module
from quantlab.generation import compile_for_decoding, disable_compiled_decoding
from quantlab.generation.attention import ONE_TOKEN_GQA, grouped_query_sdpa, use_grouped_query_sdpa
from quantlab.kernels.cpu import ops
from quantlab.testing.models import tiny_llama


def _inputs(batch: int, query_length: int, key_length: int = 20, heads: int = 4, kv_heads: int = 2, dim: int = 16):
    generator = torch.Generator().manual_seed(batch * 100 + query_length)
    query = torch.randn(batch, heads, query_length, dim, generator=generator)
    key = torch.randn(batch, kv_heads, key_length, dim, generator=generator)
    value = torch.randn(batch, kv_heads, key_length, dim, generator=generator)
    mask = torch.rand(batch, 1, query_length, key_length, generator=generator) > 0.3
    mask[..., 0] = True  # every query sees at least one position
    return query, key, value, mask


@pytest.fixture
def layer():
    """A marked grouped-query attention layer (4 query heads, 2 key/value heads)."""
    model = tiny_llama()
    use_grouped_query_sdpa(model)
    module = model.model.layers[0].self_attn
    assert module.num_key_value_groups == 2 and getattr(module, ONE_TOKEN_GQA)
    return module


@pytest.fixture
def plain_calls(layer, monkeypatch):
    """The query shapes grouped_query_sdpa hands to the "sdpa" attention it replaced."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(tuple(args[1].shape))
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr(attention_module, "_plain_sdpa", counted)
    return calls


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_one_token_queries_give_sdpa_attention_values_on_their_own(layer, plain_calls, batch, masked):
    query, key, value, mask = _inputs(batch, 1)
    mask = mask if masked else None
    expected, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.25)
    got, weights = grouped_query_sdpa(layer, query, key, value, mask, scaling=0.25)
    assert plain_calls == [] and weights is None
    assert got.shape == expected.shape == (batch, 1, 4, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_prompts_per_head_masks_repeated_keys_and_unmarked_layers_go_to_transformers(layer, plain_calls):
    query, key, value, mask = _inputs(2, 5)
    expected, _ = sdpa_attention_forward(layer, query, key, value, mask)
    torch.testing.assert_close(grouped_query_sdpa(layer, query, key, value, mask)[0], expected)
    query, key, value, mask = _inputs(2, 1)
    per_head = mask.expand(2, 4, 1, 20)
    expected, _ = sdpa_attention_forward(layer, query, key, value, per_head)
    torch.testing.assert_close(grouped_query_sdpa(layer, query, key, value, per_head)[0], expected)
    unmarked = tiny_llama().model.layers[0].self_attn
    grouped_query_sdpa(unmarked, query, key, value, mask)
    repeated_key, repeated_value = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
    with pytest.raises(RuntimeError, match="must match the size"):  # as transformers' own attention does
        grouped_query_sdpa(layer, query, repeated_key, repeated_value, mask)
    assert plain_calls == [(2, 4, 5, 16), (2, 4, 1, 16), (2, 4, 1, 16), (2, 4, 1, 16)]


def test_the_fast_path_marks_sdpa_models_and_keeps_their_attention_implementation():
    model = tiny_llama()
    compile_for_decoding(model, max_cache_len=32)
    assert model.config._attn_implementation == "sdpa"  # continuous batching accepts only its own names
    assert AttentionInterface._global_mapping["sdpa"] is grouped_query_sdpa
    assert all(getattr(layer.self_attn, ONE_TOKEN_GQA) for layer in model.model.layers)
    disable_compiled_decoding(model)
    assert not any(hasattr(layer.self_attn, ONE_TOKEN_GQA) for layer in model.model.layers)
    eager_attention = tiny_llama()
    eager_attention.set_attn_implementation("eager")
    compile_for_decoding(eager_attention, max_cache_len=32)
    assert not any(hasattr(layer.self_attn, ONE_TOKEN_GQA) for layer in eager_attention.model.layers)


def test_the_compiled_step_takes_the_copy_free_route(plain_calls):
    """Traced into the step's graph: prompts go to transformers' attention, one-token steps never do."""
    model = tiny_llama(seed=2)
    model.generation_config.pad_token_id = 0
    expected = model.generate(torch.tensor([[5, 17, 42, 9]]), max_new_tokens=6, do_sample=False)  # unmarked
    plain_calls.clear()
    torch._dynamo.reset()
    compile_for_decoding(model, max_cache_len=32)
    got = model.generate(torch.tensor([[5, 17, 42, 9]]), max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)
    assert plain_calls and all(shape[2] > 1 for shape in plain_calls)  # the prompt's layers only
    with torch.profiler.profile() as profiler:  # compiled by now: what runs, not what is traced
        model.generate(torch.tensor([[5, 17, 42, 9]]), max_new_tokens=6, do_sample=False)
    native_calls = sum(event.count for event in profiler.key_averages() if event.key == "quantlab::attention")
    assert native_calls == (5 * len(model.model.layers) if ops.available() else 0)  # 5 one-token steps


def test_a_mask_that_broadcasts_over_positions_gives_sdpa_attention_values(layer, plain_calls):
    """[batch, 1, 1, 1] is not one row per position: torch's SDPA takes it (it broadcasts), not the operator."""
    query, key, value, _ = _inputs(3, 1)
    mask = torch.tensor([True, True, True]).view(3, 1, 1, 1)
    expected, _ = sdpa_attention_forward(layer, query, key, value, mask)
    torch.testing.assert_close(grouped_query_sdpa(layer, query, key, value, mask)[0], expected)
    assert not attention_module._one_row_per_sequence(mask, 3, key.shape[2])
    assert attention_module._one_row_per_sequence(mask.expand(3, 1, 1, 20), 3, 20)
