"""The compiled static-cache decode path: the eager tokens, one compilation, no graph break."""

import pytest
import torch

import quantlab
from quantlab.errors import ConfigError
from quantlab.generation import compile_for_decoding, count_compilations, disable_compiled_decoding, warm_up
from quantlab.testing.architectures import tiny_causal_lm
from quantlab.testing.models import tiny_bert, tiny_llama

MODELS = {
    "fp32": None,
    "4bit-g32": quantlab.CustomBitsConfig(bits=4, group_size=32),
    "nf4": quantlab.NF4Config(blocksize=32),
}
PROMPTS = [torch.tensor([[5, 17, 42, 9, 100, 3]]), torch.tensor([[7, 8, 200, 31, 64, 64, 12, 250, 1, 90, 77]])]


def _generate(model, ids, tokens, **kwargs):
    kwargs.setdefault("do_sample", False)
    mask = torch.ones_like(ids)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
    return out[:, ids.shape[1] :]


@pytest.fixture(scope="module", params=list(MODELS))
def models(request):
    """(eager, compiled): the same weights, one decoding plainly, one on the fast path, warmed up."""
    pair = []
    for _ in range(2):
        model = tiny_llama(seed=3)
        if MODELS[request.param] is not None:
            quantlab.quantize(model, MODELS[request.param])
        model.generation_config.pad_token_id = 0
        pair.append(model)
    eager, compiled = pair
    torch._dynamo.reset()
    compile_for_decoding(compiled, max_cache_len=64)
    counts = warm_up(compiled)
    assert counts.graph_breaks == 0, counts.break_reasons
    assert counts.frames == 1 and counts.graphs == 1  # the decode step, compiled once, as one graph
    return eager, compiled


def test_compiled_decoding_gives_the_eager_greedy_tokens_without_recompiling(models):
    eager, compiled = models
    with count_compilations() as counts:
        fast = [_generate(compiled, ids, tokens) for ids, tokens in zip(PROMPTS, (12, 20), strict=True)]
    assert (counts.frames, counts.graphs, counts.graph_breaks) == (0, 0, 0), counts.break_reasons
    for ids, tokens, tokens_fast in zip(PROMPTS, (12, 20), fast, strict=True):
        assert torch.equal(tokens_fast, _generate(eager, ids, tokens))
    assert compiled.generation_config.cache_implementation == "static"


def test_sampling_options_draw_the_eager_tokens(models):
    eager, compiled = models
    options = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.2}
    drawn = []
    for model in (eager, compiled):
        torch.manual_seed(11)
        drawn.append(_generate(model, PROMPTS[0], 10, **options))
    assert torch.equal(*drawn)


def test_a_padded_batch_compiles_once_more_and_decodes_each_row_as_eager(models):
    eager, compiled = models
    ids = torch.tensor([[0, 0, 0, 5, 17, 42], [7, 8, 200, 31, 64, 12]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kwargs = {"attention_mask": mask, "max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    with count_compilations() as counts:
        fast = compiled.generate(ids, **kwargs)
        again = compiled.generate(ids, **kwargs)
    assert counts.graph_breaks == 0 and counts.frames == 1  # batch size 2: a second graph, compiled once
    assert torch.equal(fast, again)
    assert torch.equal(fast, eager.generate(ids, **kwargs))


# Quantized mixtures of experts: (model type, seed, config). One compilation each.
MIXTURES = {
    "qwen3_moe-4bit-g32": ("qwen3_moe", 2, quantlab.CustomBitsConfig(bits=4, group_size=32)),
    "mixtral-4bit-g32": ("mixtral", 1, quantlab.CustomBitsConfig(bits=4, group_size=32)),
    "mixtral-nf4": ("mixtral", 1, quantlab.NF4Config(blocksize=32)),
}
MIXTURE_TOKENS = 12


@pytest.fixture(scope="module", params=list(MIXTURES))
def mixture(request):
    """(model, its eager greedy tokens for each prompt): a quantized tiny mixture of experts, then compiled
    for decoding and warmed up as one graph."""
    model_type, seed, config = MIXTURES[request.param]
    model = quantlab.quantize(tiny_causal_lm(model_type, seed=seed), config, progress=False)
    model.generation_config.pad_token_id = 0
    eager = [_generate(model, ids, MIXTURE_TOKENS) for ids in PROMPTS]
    torch._dynamo.reset()
    compile_for_decoding(model, max_cache_len=32)  # fullgraph: a graph break would be an error
    counts = warm_up(model)
    assert counts.graph_breaks == 0, counts.break_reasons
    assert counts.frames == 1 and counts.graphs == 1
    return model, eager


def test_a_quantized_mixture_of_experts_decodes_compiled_in_one_graph_as_eager(mixture):
    model, eager = mixture
    with count_compilations() as counts:
        fast = [_generate(model, ids, MIXTURE_TOKENS) for ids in PROMPTS]
    assert (counts.frames, counts.graphs, counts.graph_breaks) == (0, 0, 0), counts.break_reasons
    for tokens_fast, tokens in zip(fast, eager, strict=True):
        assert torch.equal(tokens_fast, tokens)
        assert len(set(tokens[0].tolist())) > MIXTURE_TOKENS // 2  # tokens that vary: routed to varied experts


def test_disabling_returns_to_eager_decoding():
    model = tiny_llama()
    compile_for_decoding(model, max_cache_len=32)
    disable_compiled_decoding(model)
    with count_compilations() as counts:
        model.generate(PROMPTS[0], attention_mask=torch.ones_like(PROMPTS[0]), max_new_tokens=3, pad_token_id=0)
    assert counts.frames == 0
    assert model.generation_config.cache_implementation is None


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"max_cache_len": 0}, "max_cache_len must be an integer >= 2"),
        ({"max_cache_len": 64.0}, "max_cache_len must be an integer >= 2"),
        ({"mode": "reduce-overhead"}, "needs CUDA graphs; on CPU use one of default"),
    ],
)
def test_bad_arguments_are_one_clear_error(arguments, message):
    with pytest.raises(ConfigError, match=message):
        compile_for_decoding(tiny_llama(), **arguments)


def test_a_model_that_does_not_generate_is_refused():
    with pytest.raises(ConfigError, match="does not generate text"):
        compile_for_decoding(tiny_bert())


def _swap_output_head(model) -> None:
    """Replace the output head by a new module whose every logit favours token 1."""
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    torch.nn.init.zeros_(head.weight)
    with torch.no_grad():
        head.bias.zero_()
        head.bias[1] = 1.0
    model.lm_head = head


@pytest.mark.parametrize("module_guards", [False, True])
def test_module_guards_decide_whether_a_swapped_module_is_seen(module_guards):
    """With module guards the step recompiles and decodes with a module replaced after compiling; without
    them (the fast default) it does not: it runs the graph traced from the old modules, as documented."""
    model = tiny_llama(seed=5)
    model.generation_config.pad_token_id = 0
    torch._dynamo.reset()
    compile_for_decoding(model, max_cache_len=32, module_guards=module_guards)
    before = _generate(model, PROMPTS[0], 6)
    _swap_output_head(model)
    after = _generate(model, PROMPTS[0], 6)
    if module_guards:
        assert torch.equal(after[:, 1:], torch.ones_like(after[:, 1:]))  # the compiled steps use the new head
    else:  # the graph of the old head (no bias) reads the new head's weight: neither old nor new tokens
        assert not torch.equal(after[:, 1:], torch.ones_like(after[:, 1:]))
        assert not torch.equal(after, before)


def test_a_compile_mode_combines_with_options_and_the_model_still_saves(tmp_path):
    model = tiny_llama()
    config = compile_for_decoding(model, max_cache_len=32, mode="max-autotune-no-cudagraphs").generation_config
    compile_config = config.compile_config
    assert compile_config.mode is None and compile_config.options["max_autotune"] is True
    assert "guard_filter_fn" in compile_config.options
    model.save_pretrained(tmp_path)
    assert (tmp_path / "generation_config.json").is_file()


def test_two_models_of_one_class_in_one_process_each_decode_as_their_eager_selves():
    """Module guards are off by default, so each model gets a decode step of its own: a quantized model
    compiled after a float one of the same class must not run the float one's graph."""
    torch._dynamo.reset()
    float_model, quantized = tiny_llama(seed=7), tiny_llama(seed=7)
    quantlab.quantize(quantized, quantlab.CustomBitsConfig(bits=3, group_size=32))
    for model in (float_model, quantized):
        model.generation_config.pad_token_id = 0
    expected = [_generate(model, PROMPTS[1], 8) for model in (float_model, quantized)]
    for model in (float_model, quantized):
        compile_for_decoding(model, max_cache_len=32)
    for model, tokens in zip((float_model, quantized), expected, strict=True):
        assert torch.equal(_generate(model, PROMPTS[1], 8), tokens)
    assert not torch.equal(*expected)  # the two models do decode differently
