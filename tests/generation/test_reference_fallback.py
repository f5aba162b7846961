"""The fast decode path without native kernels (`QUANTLAB_NATIVE_KERNELS=0`, or no C compiler): every
quantized layer runs the reference kernel (dequantize, then matmul), which traces as torch ops, so
`compile_for_decoding` keeps fullgraph and the step is one graph giving the eager tokens."""

import pytest
import torch

import quantlab
from quantlab.generation import count_compilations
from quantlab.testing.decoding import compiled_for_decoding
from quantlab.testing.models import tiny_llama

METHODS = {
    "int8": quantlab.Int8SymmetricConfig(),
    "nf4-double-quant": quantlab.NF4Config(blocksize=32),
    "nf4-plain": quantlab.NF4Config(blocksize=32, double_quant=False),
    "2bit-g32": quantlab.CustomBitsConfig(bits=2, group_size=32),
    "3bit-g32-symmetric": quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True),
    "4bit-g32-int8-vocabulary": quantlab.CustomBitsConfig(bits=4, group_size=32, embedding_bits=8),
    "8bit-g32-4bit-vocabulary": quantlab.CustomBitsConfig(bits=8, group_size=32, embedding_bits=4),
}
PROMPT = torch.tensor([[7, 8, 200, 31, 64, 64, 12, 250, 1, 90, 77]])


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setenv("QUANTLAB_NATIVE_KERNELS", "0")


def _generate(model, tokens: int = 12):
    mask = torch.ones_like(PROMPT)
    out = model.generate(PROMPT, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[:, PROMPT.shape[1] :]


@pytest.mark.parametrize("method", list(METHODS))
def test_the_reference_kernel_compiles_into_one_graph_and_decodes_the_eager_tokens(method):
    eager, compiled = (quantlab.quantize(tiny_llama(seed=3), METHODS[method]) for _ in range(2))
    for model in (eager, compiled):
        model.generation_config.pad_token_id = 0
    compiled_for_decoding(compiled)
    with count_compilations() as again:
        fast = _generate(compiled)
    assert (again.frames, again.graphs, again.graph_breaks) == (0, 0, 0), again.break_reasons
    assert torch.equal(fast, _generate(eager))
