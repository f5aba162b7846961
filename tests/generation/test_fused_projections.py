"""Fused projections in the compiled decode step: q/k/v and gate/up as one `quantlab::linear_group` call
each, the tokens (and logits) of the unfused step, one compilation, nothing stored changed."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import quantlab
from quantlab.generation import count_compilations
from quantlab.generation.fusion import FUSE_PROJECTIONS
from quantlab.kernels.cpu import native, ops
from quantlab.testing.decoding import compiled_for_decoding
from quantlab.testing.models import tiny_llama

PROMPT = torch.tensor([[7, 8, 200, 31, 64, 64, 12, 250, 1, 90, 77]])
LAYERS = 2  # tiny_llama's blocks: 7 quantized projections each, q/k/v and gate/up reading one input each


class QuantlabCalls(str, CustomGraphPass):
    """A post-grad pass (after quantlab's) that counts the quantlab operator calls of each compiled graph
    in `counters["quantlab_calls"]` (the compile options are deep-copied: the pass keeps no state)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        targets = [str(node.target) for node in graph.nodes]
        counters["quantlab_calls"]["graphs"] += 1
        for name in ("linear", "linear_group"):
            counters["quantlab_calls"][name] += targets.count(f"quantlab.{name}.default")

    def uuid(self) -> str:
        return "quantlab tests: count quantlab calls"


COUNT_CALLS = QuantlabCalls("quantlab tests: count quantlab calls")


@pytest.fixture(scope="module", autouse=True)
def no_compile_caches():
    """Compile every graph here: a cached one skips the passes (the fused graph is cached, keyed on the
    pass's uuid), so the counts this file inspects would stay zero."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def _quantized_llama():
    model = tiny_llama(seed=3)
    quantlab.quantize(model, quantlab.CustomBitsConfig(bits=4, group_size=32))
    model.generation_config.pad_token_id = 0
    return model


def _decode(model, tokens: int = 16):
    out = model.generate(
        PROMPT,
        attention_mask=torch.ones_like(PROMPT),
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.logits)


def _compiled(model=None, **decoding_options):
    """A compiled, warmed-up model (default: `_quantized_llama()`); the quantlab calls its decode graph
    holds; what the pass counted."""
    model = model if model is not None else _quantized_llama()
    counters.clear()
    compiled_for_decoding(model, options={"post_grad_custom_post_pass": COUNT_CALLS}, **decoding_options)
    calls = {name: counters["quantlab_calls"][name] for name in ("graphs", "linear", "linear_group")}
    return model, calls, dict(counters["quantlab"])


@pytest.fixture(scope="module")
def operators():
    if not ops.available():
        pytest.skip("quantlab's torch operators could not be built here (no C/C++ compiler?)")
    return ops


@pytest.fixture(scope="module")
def unfused(operators):
    return _compiled(fuse_projections=False)


def test_the_fused_step_makes_four_calls_a_block_and_decodes_as_the_unfused_and_eager_ones(unfused):
    model, calls, fused = _compiled(fuse_projections=True)
    assert fused == {"projection_groups": 2 * LAYERS, "fused_projections": 5 * LAYERS}
    assert calls == {"graphs": 1, "linear": 2 * LAYERS, "linear_group": 2 * LAYERS}  # o_proj and down_proj stay alone
    with count_compilations() as counts:
        tokens, logits = _decode(model)
    assert (counts.frames, counts.graphs, counts.graph_breaks) == (0, 0, 0), counts.break_reasons
    unfused_tokens, unfused_logits = _decode(unfused[0])
    assert torch.equal(tokens, unfused_tokens)
    assert torch.equal(logits, unfused_logits)  # each projection's values are the unfused call's, bit for bit
    assert torch.equal(tokens, _decode(_quantized_llama())[0])  # eager, unfused


def test_fuse_projections_false_leaves_one_call_per_layer(unfused):
    _, calls, fused = unfused
    assert calls == {"graphs": 1, "linear": 7 * LAYERS, "linear_group": 0}
    assert fused == {}


def test_nothing_stored_changes(unfused, tmp_path):
    model, _, _ = _compiled(fuse_projections=True)
    attention = model.model.layers[0].self_attn
    assert all(hasattr(attention, name) for name in ("q_proj", "k_proj", "v_proj"))
    model.save_pretrained(tmp_path)
    assert set(model.state_dict()) == set(_quantized_llama().state_dict())


def _two_projections():
    torch.manual_seed(0)
    config = quantlab.NF4Config(blocksize=32)
    method = quantlab.get_method(config.method).module_class
    return [method.from_linear(torch.nn.Linear(64, n, bias=False), config) for n in (48, 16)]


def test_the_pass_fuses_inference_graphs_only(operators):
    """A graph that trains keeps one call per layer (linear_group has no gradient) and its gradients."""
    q, k = _two_projections()

    def project(x):
        return torch.cat([q(x), k(x)], dim=-1)

    def loss(x):
        return project(x).square().sum()

    options = {"post_grad_custom_post_pass": (FUSE_PROJECTIONS, COUNT_CALLS)}
    x = torch.randn(3, 64)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        assert torch.equal(torch.compile(project, fullgraph=True, options=options)(x), project(x))
    assert counters["quantlab"]["projection_groups"] == 1 and counters["quantlab_calls"]["linear"] == 0
    counters.clear()
    leaf, expected = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    torch.compile(loss, fullgraph=True, options=options)(leaf).backward()
    assert counters["quantlab"]["projection_groups"] == 0 and counters["quantlab_calls"]["linear"] == 2
    loss(expected).backward()
    torch.testing.assert_close(leaf.grad, expected.grad)


def test_without_native_kernels_the_graphs_hold_no_quantlab_call_and_nothing_fuses(operators, monkeypatch):
    """The reference kernel traces as plain torch ops, in one graph, so the pass finds nothing to fuse
    and changes nothing (the whole fast path without native kernels: test_reference_fallback.py)."""
    q, k = _two_projections()

    def project(x):
        return torch.cat([q(x), k(x)], dim=-1)

    x = torch.randn(3, 64)
    monkeypatch.setenv("QUANTLAB_NATIVE_KERNELS", "0")
    options = {"post_grad_custom_post_pass": (FUSE_PROJECTIONS, COUNT_CALLS)}
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        assert torch.equal(torch.compile(project, fullgraph=True, options=options)(x), project(x))
    assert counters["quantlab_calls"]["graphs"] == 1
    assert counters["quantlab_calls"]["linear"] == counters["quantlab_calls"]["linear_group"] == 0
    assert counters["quantlab"]["projection_groups"] == 0


@pytest.mark.parametrize(
    "config, tied",
    [
        (quantlab.CustomBitsConfig(bits=4, group_size=64, embedding_bits=8), True),
        (quantlab.Int8SymmetricConfig(embedding_bits=8), False),  # one group per row: 64 or 192 inputs
    ],
    ids=["4bit-g64-e8-tied", "int8-e8"],
)
def test_int8_activations_run_every_eligible_layer_of_the_step_on_the_int8_kernel(operators, config, tied):
    """`int8_activations=True`: every 4-bit g64 or int8 layer of the step, the int8 output head (tied or
    not) included, is a `linear_group` call with activation_bits 8 (fused or alone), one compilation, and
    logits near the float step's (x rounded to 8 bits: close, not equal)."""

    def compiled(int8_activations: bool):
        model = quantlab.quantize(tiny_llama(seed=3, tie_word_embeddings=tied), config)
        model.generation_config.pad_token_id = 0
        return _compiled(model, int8_activations=int8_activations)

    model, calls, done = compiled(int8_activations=True)
    assert done["int8_activation_layers"] == 7 * LAYERS + 1 and done["fused_projections"] == 5 * LAYERS
    assert calls["linear"] == 0 and calls["linear_group"] == 4 * LAYERS + 1
    with count_compilations() as counts:
        _, logits = _decode(model, tokens=4)
    assert (counts.frames, counts.graphs, counts.graph_breaks) == (0, 0, 0), counts.break_reasons
    _, float_logits = _decode(compiled(int8_activations=False)[0], tokens=4)
    relative = ((logits - float_logits).norm() / float_logits.norm()).item()
    assert relative < 0.05
    if native.int8_activations_supported():
        assert relative > 0  # the int8 kernel ran (without AVX2 it computes in float: equal logits)
