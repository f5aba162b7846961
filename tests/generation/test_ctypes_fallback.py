"""The fast decode path when the C library loads but quantlab's torch operators do not (a C compiler,
no C++ one): quantized layers call the C library through ctypes, and under torch.compile through the
Python operator `quantlab_ctypes::linear`, so every layer keeps its own weight, the step is one graph,
and it decodes the eager greedy tokens. Simulated by reporting the operators unavailable."""

import pytest
import torch

import quantlab
from quantlab.generation import count_compilations
from quantlab.kernels.cpu import native, ops, traced
from quantlab.kernels.cpu.linear import ctypes_linear
from quantlab.kernels.cpu.weights import describe_arguments as describe
from quantlab.testing.decoding import compiled_for_decoding
from quantlab.testing.models import tiny_llama

METHODS = {
    "4bit-g32": quantlab.CustomBitsConfig(bits=4, group_size=32),
    "nf4-double-quant": quantlab.NF4Config(blocksize=32),
    "int8": quantlab.Int8SymmetricConfig(),
}
PROMPT = torch.tensor([[7, 8, 200, 31, 64, 64, 12, 250, 1, 90, 77]])


@pytest.fixture(autouse=True)
def ctypes_kernels(monkeypatch):
    if native.library() is None:
        pytest.skip("the native CPU kernels could not be built here (no C compiler?)")
    monkeypatch.setattr(ops, "available", lambda: False)


def _generate(model, tokens: int = 12):
    mask = torch.ones_like(PROMPT)
    out = model.generate(
        PROMPT,
        attention_mask=mask,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, PROMPT.shape[1] :], torch.stack(out.logits)


def test_compiled_layers_of_different_shapes_each_use_their_own_weight():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64), torch.nn.Linear(64, 32))
    quantlab.quantize(layers, quantlab.CustomBitsConfig(bits=4, group_size=32))
    x = torch.randn(2, 64, requires_grad=True)

    def project(x):
        hidden = layers[0](x)
        return hidden, layers[1](hidden), layers[2](x)

    torch._dynamo.reset()
    backend = torch._dynamo.testing.EagerAndRecordGraphs()
    compiled = torch.compile(project, backend=backend, fullgraph=True)(x)
    targets = [str(node.target) for graph in backend.graphs for node in graph.graph.nodes]
    assert sum(target.startswith("quantlab_ctypes.linear") for target in targets) == 3, targets
    eager = project(x)
    for got, expected in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(compiled[2], ctypes_linear(layers[2], x) + layers[2].bias)
    grad = torch.autograd.grad(sum(out.sum() for out in compiled), x)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(sum(out.sum() for out in eager), x)[0])


@pytest.mark.parametrize("method", list(METHODS))
def test_the_compiled_step_decodes_the_eager_tokens_in_one_graph(method, monkeypatch):
    eager, compiled = (quantlab.quantize(tiny_llama(seed=3), METHODS[method]) for _ in range(2))
    for model in (eager, compiled):
        model.generation_config.pad_token_id = 0
    compiled_for_decoding(compiled)
    with count_compilations() as again:
        fast_tokens, fast_logits = _generate(compiled)
    assert (again.frames, again.graphs, again.graph_breaks) == (0, 0, 0), again.break_reasons
    described = []
    monkeypatch.setattr(traced, "describe_arguments", lambda *weight: described.append(1) or describe(*weight))
    _generate(compiled, tokens=2)
    assert len(described) == 7 * 2  # the one compiled step ran every projection through the C library
    eager_tokens, eager_logits = _generate(eager)
    assert torch.equal(fast_tokens, eager_tokens)
    torch.testing.assert_close(fast_logits, eager_logits, rtol=1e-4, atol=1e-4)
