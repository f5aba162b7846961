"""The native decode step on a quantized KV cache (`compile_for_decoding(kv_bits=8, native_step=True)`, or a
`QuantizedKVCache(..., capacity=N)` passed to `generate`): the codes read as they are stored."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import quantlab
from quantlab.errors import ConfigError
from quantlab.generation import compile_for_decoding, disable_compiled_decoding
from quantlab.generation.kv_cache import STORED_TENSORS, QuantizedKVCache
from quantlab.kernels.cpu import native
from quantlab.testing.greedy import GREEDY_64, SMOLLM2_PROMPTS, assert_same_tokens_but_near_ties
from quantlab.testing.models import tiny_bert, tiny_llama

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native CPU kernels are not built here")

PROMPT = torch.tensor([[1, 5, 9, 33, 70, 2, 8] * 3])
TOKENS = 60
GENERATE = {"max_new_tokens": TOKENS, "min_new_tokens": TOKENS, "do_sample": False}
LOGITS = {**GENERATE, "output_logits": True, "return_dict_in_generate": True}


def _quantized(head_dim: int | None = None):
    """A 4-bit tiny Llama (the native step needs quantized projections); head_dim 64 takes the vector kernels."""
    if head_dim is None:
        model = tiny_llama(seed=3)  # head_dim 16: the scalar kernels
    else:
        torch.manual_seed(3)
        config = LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        )  # fmt: skip
        model = LlamaForCausalLM(config).eval()
    model = quantlab.quantize(model, quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    return model


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(params=["vector", "scalar"])
def isa(request):
    before = native.isa()
    if request.param == "vector" and before == "scalar":
        pytest.skip("no AVX2 here")
    native.force_isa("scalar" if request.param == "scalar" else before)
    yield request.param
    native.force_isa(before)


@pytest.mark.parametrize(("head_dim", "group_size"), [(None, 64), (64, 64), (64, 32), (64, 16)])
def test_native_steps_on_codes_decode_as_the_eager_cache(isa, head_dim, group_size):
    """The same tokens as the eager model on the same cache layout, logits equal to the rounding of a code
    (a key or value computed in another order can round to the next code), past the capacity too."""
    model = _quantized(head_dim)
    options = {"bits": 8, "residual_length": 16, "group_size": group_size}
    reference = model.generate(PROMPT, past_key_values=QuantizedKVCache(model.config, **options), **LOGITS)
    compile_for_decoding(model, max_cache_len=48, native_step=True)
    cache = QuantizedKVCache(model.config, capacity=48, **options)
    out = model.generate(PROMPT, past_key_values=cache, **LOGITS)
    step = model._compiled_call
    assert (step.native_steps, step.fallback_steps, step.lean_loops) == (TOKENS - 1, 0, 1)
    assert torch.equal(out.sequences, reference.sequences)
    assert _relative(torch.stack(out.logits), torch.stack(reference.logits)) < 1e-3
    layer = cache.layers[0]
    assert layer.stored_length == 80 and layer.window_length == 0 and cache.get_seq_length() == 80
    assert layer.allocated_tensors()["key_codes"].shape[-2] == 96  # grown past its 48 tokens
    expected = reference.past_key_values.layers[0]
    codes_differ = (layer.key_codes.int() - expected.key_codes.int()).abs()
    assert codes_differ.max() <= 1 and codes_differ.float().mean() < 0.01


def test_kv_bits_gives_every_generation_a_quantized_cache():
    model = _quantized(64)
    compile_for_decoding(model, max_cache_len=300, native_step=True, kv_bits=8)
    long_prompt = torch.randint(3, 250, (1, 200))
    out = model.generate(long_prompt, **LOGITS)
    cache = out.past_key_values
    assert isinstance(cache, QuantizedKVCache) and cache.bits == 8 and cache.capacity == 300
    assert model._compiled_call.native_steps == TOKENS - 1
    assert cache.layers[0].stored_length == 256  # two chunks of 128, the rest in the window
    disable_compiled_decoding(model)
    reference = model.generate(long_prompt, past_key_values=QuantizedKVCache(model.config, bits=8), **LOGITS)
    assert torch.equal(out.sequences, reference.sequences)


def test_batches_and_padding_decode_eagerly_on_the_quantized_cache():
    model = _quantized()
    compile_for_decoding(model, max_cache_len=64, native_step=True, kv_bits=8)
    prompts = torch.tensor([[0, 0, 7, 9, 11], [4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = model.generate(prompts, attention_mask=mask, return_dict_in_generate=True, **GENERATE)
    assert out.sequences.shape == (2, 5 + TOKENS) and isinstance(out.past_key_values, QuantizedKVCache)
    assert model._compiled_call.native_steps == 0
    disable_compiled_decoding(model)
    cache = QuantizedKVCache(model.config, bits=8, capacity=64)
    assert torch.equal(model.generate(prompts, attention_mask=mask, past_key_values=cache, **GENERATE), out.sequences)


def test_a_four_bit_cache_decodes_eagerly_beside_the_native_step():
    model = _quantized()
    reference = model.generate(PROMPT, past_key_values=QuantizedKVCache(model.config, bits=4), **GENERATE)
    compile_for_decoding(model, max_cache_len=64, native_step=True)
    out = model.generate(PROMPT, past_key_values=QuantizedKVCache(model.config, bits=4), **GENERATE)
    assert torch.equal(out, reference) and model._compiled_call.native_steps == 0


def test_a_float_static_cache_still_takes_the_native_step():
    model = _quantized()
    reference = model.generate(PROMPT, past_key_values=DynamicCache(), **GENERATE)
    compile_for_decoding(model, max_cache_len=96, native_step=True)
    assert torch.equal(model.generate(PROMPT, **GENERATE), reference)
    assert model._compiled_call.native_steps == TOKENS - 1


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"kv_bits": 4, "native_step": True}, "at 8 bits"),
        ({"kv_bits": 8}, "native_step=True"),
        ({"kv_bits": 16, "native_step": True}, "kv_bits=16"),
    ],
)
def test_kv_bits_the_native_step_does_not_read_are_refused(options, fragment):
    with pytest.raises(ConfigError, match=fragment) as error:
        compile_for_decoding(_quantized(), max_cache_len=64, **options)
    assert "\n" not in str(error.value)


def test_an_encoder_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        compile_for_decoding(tiny_bert(), max_cache_len=64, native_step=True, kv_bits=8)
    assert "\n" not in str(error.value)


def test_capacity_changes_where_tensors_live_not_what_they_hold():
    config = tiny_llama().config
    grown, allocated = (
        QuantizedKVCache(config, residual_length=8),
        QuantizedKVCache(config, residual_length=8, capacity=20),
    )
    torch.manual_seed(0)
    for tokens in (13, 1, 1, 5, 1, 30):  # flushes in prefill and in single steps, past the capacity
        keys, values = torch.randn(1, 2, tokens, 16), torch.randn(1, 2, tokens, 16)
        returned = grown.update(keys, values, 0)
        assert all(torch.equal(a, b) for a, b in zip(returned, allocated.update(keys, values, 0), strict=True))
    a, b = grown.layers[0], allocated.layers[0]
    assert (a.stored_length, a.window_length) == (b.stored_length, b.window_length) == (48, 3)
    for name in STORED_TENSORS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.nbytes < b.nbytes  # the allocated cache holds its whole capacity and window


@pytest.mark.slow
def test_smollm2_native_steps_on_int8_codes_keep_the_float_cache_greedy_tokens():
    """SmolLM2 4-bit e8 on the native step: 64 greedy tokens on an int8 cache (a float window of 8 tokens, so
    nearly everything attended to is codes) equal those on a float32 static cache on 3 prompts, but at
    near-ties (one, at token 29 of a prompt, margin 0.001)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantlab.assets.models import smollm2_dir

    directory = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = quantlab.CustomBitsConfig(bits=4, group_size=64, embedding_bits=8)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, quantization_config=config)
    compile_for_decoding(model, max_cache_len=128, native_step=True)
    for prompt in SMOLLM2_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        reference = model.generate(ids, **GREEDY_64)
        cache = QuantizedKVCache(model.config, bits=8, residual_length=8, capacity=128)
        assert_same_tokens_but_near_ties(reference, model.generate(ids, past_key_values=cache, **GREEDY_64), prompt)
        assert cache.layers[0].stored_length >= 64
    assert model._compiled_call.native_steps == 6 * 63


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_a_cache_filled_before_generate_continues_on_the_native_step(kv_bits):
    """A cache passed to generate (beside the static implementation compile_for_decoding sets) is taken as it is:
    a prompt read into it beforehand is not read again, and the steps after it run natively."""
    from transformers import StaticCache

    model = _quantized()
    compile_for_decoding(model, max_cache_len=96, native_step=True, kv_bits=kv_bits)
    reference = model.generate(PROMPT, **GENERATE)
    if kv_bits is None:
        cache = StaticCache(config=model.config, max_cache_len=96)
    else:
        cache = QuantizedKVCache(model.config, bits=8, capacity=96)
    with torch.no_grad():
        model(PROMPT[:, :-1], past_key_values=cache, use_cache=True)
    steps = model._compiled_call.native_steps
    assert torch.equal(model.generate(PROMPT, past_key_values=cache, **GENERATE), reference)
    assert model._compiled_call.native_steps - steps == TOKENS - 1
    assert cache.get_seq_length() == PROMPT.shape[1] + TOKENS - 1
