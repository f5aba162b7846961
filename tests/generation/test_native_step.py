"""The native decode step (`compile_for_decoding(native_step=True)`): one C call a token behind `generate`."""

import copy
import gc
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import quantlab
from quantlab.errors import ConfigError
from quantlab.generation import compile_for_decoding, disable_compiled_decoding
from quantlab.generation.native import NativeDecodeStep
from quantlab.kernels.cpu import huge_pages, native
from quantlab.testing.models import tiny_llama, tiny_qwen2

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native CPU kernels are not built here")

PROMPT = torch.tensor([[1, 5, 9, 33, 70, 2, 8]])
TOKENS = 10


def _decode(model, prompt=PROMPT, **options):
    out = model.generate(
        prompt,
        attention_mask=options.pop("attention_mask", torch.ones_like(prompt)),
        max_new_tokens=TOKENS,
        min_new_tokens=TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
        **{"do_sample": False, **options},
    )
    return out.sequences, torch.stack(out.logits)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _native(model, **options) -> NativeDecodeStep:
    compile_for_decoding(model, max_cache_len=64, native_step=True, **options)
    step = model._compiled_call
    assert isinstance(step, NativeDecodeStep)
    return step


CONFIGS = {
    "4bit-g32": (lambda: quantlab.CustomBitsConfig(bits=4, group_size=32), False),
    "4bit-g64-e8-tied": (lambda: quantlab.CustomBitsConfig(bits=4, group_size=64, embedding_bits=8), True),
    "int8-e8": (lambda: quantlab.Int8SymmetricConfig(embedding_bits=8), False),
    "nf4-dq": (lambda: quantlab.NF4Config(double_quant=True), False),
    "iq4_nl-e8-tied": (lambda: quantlab.IQ4NLConfig(embedding_bits=8, embedding_group_size=32), True),
    "3bit-asym": (lambda: quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=False), False),
    "lut3-learned-tables": (lambda: quantlab.LutConfig(bits=3, group_size=32), False),  # each layer its own table
    # q/k/v in different layouts: the step projects them one by one instead of as one group
    "mixed-qkv": (
        lambda: quantlab.CustomBitsConfig(
            bits=4,
            group_size=32,
            layer_options={f"model.layers.{i}.self_attn.k_proj": {"bits": 8} for i in range(2)},
        ),
        False,
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_native_step_decodes_as_the_eager_model(name):
    """Every step after the prompt runs natively, with the eager model's greedy tokens and logits (the
    same kernels; attention and norms summed in another order, so equal to a few ulps, not bit for bit)."""
    make_config, tied = CONFIGS[name]
    model = quantlab.quantize(tiny_llama(seed=3, tie_word_embeddings=tied), make_config())
    model.generation_config.pad_token_id = 0
    tokens, logits = _decode(model)
    step = _native(model)
    native_tokens, native_logits = _decode(model)
    assert (step.native_steps, step.fallback_steps) == (TOKENS - 1, 0)
    assert torch.equal(native_tokens, tokens)
    assert _relative(native_logits, logits) < 1e-5


@pytest.mark.parametrize("isa", [0, 1, 2], ids=["scalar", "avx2", "avx512"])
def test_the_native_step_decodes_as_the_eager_model_at_every_instruction_set(isa):
    """The step's own vector code (attention, SiLU, dot products) exists per instruction set; each one the
    CPU has gives the eager model's tokens, eager and native both at that instruction set."""
    lib = native.library()
    if isa > lib.ql_isa():
        pytest.skip("this CPU lacks that instruction set")
    model = quantlab.quantize(tiny_llama(seed=3), quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    lib.ql_force_isa(isa)
    try:
        tokens, logits = _decode(model)
        step = _native(model)
        native_tokens, native_logits = _decode(model)
    finally:
        lib.ql_force_isa(-1)
    assert (step.native_steps, step.fallback_steps) == (TOKENS - 1, 0)
    assert torch.equal(native_tokens, tokens)
    assert _relative(native_logits, logits) < 1e-5


def test_biases_of_a_qwen2_model_are_applied():
    model = quantlab.quantize(tiny_qwen2(seed=1), quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    tokens, logits = _decode(model)
    step = _native(model)
    native_tokens, native_logits = _decode(model)
    assert step.native_steps == TOKENS - 1
    assert torch.equal(native_tokens, tokens)
    assert _relative(native_logits, logits) < 1e-5


def test_int8_activations_run_in_the_native_step():
    model = quantlab.quantize(
        tiny_llama(seed=3, tie_word_embeddings=True), quantlab.CustomBitsConfig(bits=4, group_size=64, embedding_bits=8)
    )
    model.generation_config.pad_token_id = 0
    _, logits = _decode(model)
    step = _native(model, int8_activations=True)
    _, int8_logits = _decode(model)
    assert step.native_steps == TOKENS - 1
    relative = _relative(int8_logits, logits)
    assert relative < 0.05
    if native.int8_activations_supported():
        assert relative > 1e-4  # the int8 kernel ran (without AVX2 the layers compute in float)


def test_sampling_options_work_as_in_plain_generate():
    model = quantlab.quantize(tiny_llama(seed=3), quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    options = {"do_sample": True, "top_k": 20, "temperature": 0.8, "repetition_penalty": 1.3}
    torch.manual_seed(11)
    tokens, _ = _decode(model, **options)
    step = _native(model)
    torch.manual_seed(11)
    native_tokens, _ = _decode(model, **options)
    assert step.native_steps == TOKENS - 1
    assert torch.equal(native_tokens, tokens)


def test_padded_batches_run_the_compiled_step():
    """Two sequences, one left-padded: not the native step's case, so the compiled step takes it."""
    model = quantlab.quantize(tiny_llama(seed=3), quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    prompts = torch.tensor([[0, 0, 1, 5, 9, 33, 70], [4, 7, 1, 5, 9, 33, 70]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    tokens, _ = _decode(model, prompts, attention_mask=mask)
    torch._dynamo.reset()
    step = _native(model)
    native_tokens, _ = _decode(model, prompts, attention_mask=mask)
    assert (step.native_steps, step.fallback_steps) == (0, TOKENS - 1)
    assert torch.equal(native_tokens, tokens)
    disable_compiled_decoding(model)


def test_models_the_step_does_not_run_are_refused_in_one_line():
    float_model = tiny_llama(seed=3)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.q_proj is Linear") as error:
        compile_for_decoding(float_model, native_step=True)
    assert "\n" not in str(error.value)
    partly = quantlab.quantize(
        tiny_llama(seed=3), quantlab.CustomBitsConfig(bits=4, group_size=32, modules_to_not_convert=["down_proj"])
    )
    with pytest.raises(ConfigError, match=r"down_proj is Linear"):
        compile_for_decoding(partly, native_step=True)
    sliding = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    )  # fmt: skip
    with pytest.raises(ConfigError, match="sliding-window"):
        compile_for_decoding(sliding, native_step=True)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_quantized_table_is_looked_up_natively_with_the_modules_values(tied):
    model = quantlab.quantize(
        tiny_llama(seed=3, tie_word_embeddings=tied), quantlab.CustomBitsConfig(bits=4, group_size=32, embedding_bits=8)
    )
    step = _native(model)
    assert step.decoder.embedding is not None
    for token in (0, 17, 255):
        ids = torch.tensor([[token]])
        assert torch.equal(step.decoder._embed(ids), model.get_input_embeddings()(ids))


@pytest.mark.slow
def test_smollm2_decodes_the_eager_tokens_on_the_native_step():
    """The real model (30 blocks, 9 heads over 3 key/value heads, tied int8 table): 24 greedy tokens equal."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantlab.assets.models import smollm2_dir

    config = quantlab.CustomBitsConfig(bits=4, group_size=64, embedding_bits=8)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), quantization_config=config).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True)
    prompt = tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
    options = {"max_new_tokens": 24, "min_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
    step = _native(model)
    native_tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
    assert step.native_steps == 23
    assert torch.equal(native_tokens, tokens)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_the_lean_loop_gives_the_tokens_and_scores_of_transformers_loop_bit_for_bit(sample):
    """`model.generate` runs loop.native_sample; `type(model).generate` runs transformers' `_sample` on the
    same native step: equal sequences, scores and logits, stopping at the same end-of-sequence token."""
    model = quantlab.quantize(tiny_llama(seed=3), quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    step = _native(model)
    eos = int(_decode(model)[0][0, PROMPT.shape[1] + 5])  # a token the greedy run makes: it stops there
    options = {
        "max_new_tokens": TOKENS,
        "do_sample": sample,
        "top_k": 20,
        "temperature": 0.7,
        "eos_token_id": None if sample else eos,
        "output_scores": True,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    loops = step.lean_loops
    torch.manual_seed(5)
    lean = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **options)
    assert step.lean_loops == loops + 1
    torch.manual_seed(5)
    plain = type(model).generate(model, PROMPT, attention_mask=torch.ones_like(PROMPT), **options)
    assert step.lean_loops == loops + 1
    assert torch.equal(lean.sequences, plain.sequences)
    if not sample:
        assert lean.sequences.shape[1] < PROMPT.shape[1] + TOKENS and lean.sequences[0, -1] == eos
    for ours, theirs in ((lean.scores, plain.scores), (lean.logits, plain.logits)):
        assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_streamer_keeps_transformers_loop_on_the_native_step():
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, value):
            self.tokens += value.flatten().tolist()

        def end(self):
            self.ended = True

    model = quantlab.quantize(tiny_llama(seed=3), quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    step = _native(model)
    streamer = Collect()
    tokens = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=6, streamer=streamer)
    assert (step.lean_loops, step.native_steps) == (0, 5)
    assert streamer.ended and streamer.tokens == tokens[0].tolist()


def test_replacing_a_layer_after_set_up_is_refused_at_the_next_generation():
    """The native step reads the weights described when it was set up: a model changed since then (a layer
    swapped, tensors replaced) is an error, not a silent run on the old weights; writes in place are seen."""
    model = quantlab.quantize(tiny_llama(seed=3), quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    _native(model)
    before = _decode(model)[1]
    scale = model.model.layers[1].mlp.down_proj.weight_scale
    with torch.no_grad():
        scale.mul_(2.0)  # in place: the step reads the new values
    changed = _decode(model)[1]
    with torch.no_grad():
        scale.div_(2.0)
    assert torch.equal(_decode(model)[1], before) and not torch.equal(changed[1:], before[1:])
    original = model.model.layers[1].mlp.down_proj
    model.model.layers[1].mlp.down_proj = type(original).from_linear(
        torch.nn.Linear(original.in_features, original.out_features, bias=False), original.config
    )
    with pytest.raises(ConfigError, match="replaced after native_step was set up"):
        _decode(model)
    _native(model)  # set up again: runs
    assert _decode(model)[1].shape == before.shape
    model.model.layers[0] = copy.deepcopy(model.model.layers[0])  # an ancestor of described layers
    with pytest.raises(ConfigError, match="replaced after native_step was set up"):
        _decode(model)
    _native(model)
    norm = model.model.norm.weight
    norm.data = norm.data.clone()  # the same Parameter, new memory
    with pytest.raises(ConfigError, match="replaced after native_step was set up"):
        _decode(model)


def test_a_deep_copy_decodes_with_its_own_weights():
    model = quantlab.quantize(tiny_llama(seed=3), quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    _native(model)
    before = _decode(model)[1]
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.model.layers[1].mlp.down_proj.weight_scale.mul_(2.0)
    changed = _decode(copied)[1]
    assert copied._compiled_call.native_steps == TOKENS - 1
    assert not torch.equal(changed, before) and torch.equal(_decode(model)[1], before)


def test_a_finished_generations_cache_is_not_kept_alive():
    model = quantlab.quantize(tiny_llama(seed=3), quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    step = _native(model)
    model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=4)
    assert step.native_steps == 3
    gc.collect()
    assert step.decoder.cache_ref() is None


def test_a_step_on_one_held_team_gives_the_logits_of_a_team_call_per_product():
    """At two threads the step holds torch's thread team for its whole call and posts each product and
    attention to it, instead of one fork and join per call; every output is computed by the same code
    either way, so tokens and logits are equal bit for bit, and the team is entered once a token."""
    lib = native.library()
    if not lib.ql_uses_openmp() or torch.get_num_threads() < 2:
        pytest.skip("the step holds a team only on torch's OpenMP team with two threads or more")
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    model = quantlab.quantize(LlamaForCausalLM(config).eval(), quantlab.CustomBitsConfig(bits=4, group_size=64))
    model.generation_config.pad_token_id = 0
    step = _native(model)
    lib.ql_set_team_stall_ns(1 << 62, 0)  # a busy machine must not send the calls to the other pool here
    try:
        before = lib.ql_pool_calls(1)
        tokens, logits = _decode(model)
        held = lib.ql_pool_calls(1) - before
        lib.ql_set_teams(0)
        before = lib.ql_pool_calls(1)
        per_product_tokens, per_product_logits = _decode(model)
        per_product = lib.ql_pool_calls(1) - before
    finally:
        lib.ql_set_teams(1)
        lib.ql_set_team_stall_ns(1_000_000, 1_000_000_000)
    assert step.native_steps == 2 * (TOKENS - 1)
    assert torch.equal(tokens, per_product_tokens)
    assert torch.equal(logits, per_product_logits)
    # the prompt's eager forward calls the team the same number of times in both runs; the steps differ
    products_a_step = 4 * config.num_hidden_layers  # q/k/v, o, gate/up and down a block (the head is float)
    assert per_product - held == (TOKENS - 1) * (products_a_step - 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked of Linux")
def test_the_step_moves_the_weights_every_token_reads_into_one_huge_page_mapping():
    model = quantlab.quantize(tiny_llama(seed=3), quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    tokens, logits = _decode(model)
    projections = [m for m in model.modules() if hasattr(m, "stored_tensors")]
    before = [t.data_ptr() for m in projections for t in m.stored_tensors().values()]
    _native(model)
    after = [t.data_ptr() for m in projections for t in m.stored_tensors().values()]
    assert all(a != b for a, b in zip(after, before, strict=True))
    assert after[0] % huge_pages.HUGE_PAGE == 0 and after == sorted(after)  # one mapping, in the step's order
    native_tokens, native_logits = _decode(model)
    assert torch.equal(native_tokens, tokens) and _relative(native_logits, logits) < 1e-5


def test_a_static_ropes_angles_come_from_one_table_equal_to_the_rotary_modules_own():
    model = quantlab.quantize(tiny_llama(seed=3), quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    decoder = _native(model).decoder
    hidden = torch.zeros(1, 1, model.config.hidden_size)
    for position in (0, 7, 300):  # 300: past the first table, which grows
        cos, sin = decoder._angles(hidden, position, None)
        own_cos, own_sin = model.model.rotary_emb(hidden, torch.tensor([[position]]))
        assert torch.equal(cos, own_cos[0, 0]) and torch.equal(sin, own_sin[0, 0])
    assert decoder.angle_table[0].shape[0] > 300
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(2.0)  # the module changed in place: the table is made anew
    cos, _ = decoder._angles(hidden, 7, None)
    assert torch.equal(cos, model.model.rotary_emb(hidden, torch.tensor([[7]]))[0][0, 0])
