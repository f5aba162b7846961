"""`quantlab::attention`: one-token queries over a KV cache in C (csrc/attention.c), against torch's SDPA,
on every instruction set this CPU has; masks as transformers gives them; opcheck; bad shapes refused."""

import pytest
import torch
import torch.nn.functional as F

from quantlab.kernels.cpu import ops


@pytest.fixture(scope="module")
def attention():
    if not ops.available():
        pytest.skip("quantlab's torch operators could not be built here (no C/C++ compiler?)")
    return ops.attention_op


def _inputs(batch: int, kv_heads: int, groups: int, length: int, dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((batch, kv_heads, groups, dim), (batch, kv_heads, length, dim), (batch, kv_heads, length, dim))
    return tuple(torch.randn(*shape, generator=generator) for shape in shapes)


def _sdpa(query, key, value, mask, scale):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def _padded_mask(batch: int, length: int) -> torch.Tensor:
    """A static cache's mask: sequence b left-padded by b positions, the cache's last 7 positions unused."""
    mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool)
    for b in range(batch):
        mask[b, ..., b : length - 7] = True
    return mask


# dim 64: 32 outputs a step; 80: 8 a step; 12: no vector path (scalar loops on every instruction set)
@pytest.mark.parametrize("dim", [64, 80, 12])
@pytest.mark.parametrize("mask_kind", ["bool", "float -inf", "float min", "none", "one row for all"])
def test_values_match_sdpa(attention, isa, dim, mask_kind):
    query, key, value = _inputs(batch=3, kv_heads=2, groups=3, length=37, dim=dim)
    mask = _padded_mask(3, 37)
    expected = _sdpa(query, key, value, mask, 0.125)
    if mask_kind.startswith("float"):
        masked = float("-inf") if mask_kind == "float -inf" else torch.finfo(torch.float32).min
        mask = torch.zeros(mask.shape).masked_fill(~mask, masked)
    elif mask_kind == "none":
        mask, expected = None, _sdpa(query, key, value, None, 0.125)
    elif mask_kind == "one row for all":
        mask = mask[:1]
        expected = _sdpa(query, key, value, mask, 0.125)
    got = attention(query, key, value, mask, 0.125)
    assert got.shape == query.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_masked_positions_weigh_nothing_and_a_fully_masked_row_gives_zeros(attention, isa):
    query, key, value = _inputs(batch=2, kv_heads=1, groups=2, length=16, dim=64, seed=1)
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    mask[0, ..., 3] = False
    mask[1] = False
    poisoned = value.clone()
    poisoned[0, :, 3] = float("nan")  # a masked position's value never reaches the output
    got = attention(query, key, poisoned, mask, 0.125)
    torch.testing.assert_close(got[0], _sdpa(query, key, value, mask, 0.125)[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_opcheck(attention):
    query, key, value = _inputs(batch=2, kv_heads=2, groups=2, length=9, dim=16)
    for mask in (_padded_mask(2, 9) | True, None):
        torch.library.opcheck(attention, (query, key, value, mask, 0.25))


def test_bad_shapes_are_refused(attention):
    query, key, value = _inputs(batch=2, kv_heads=2, groups=2, length=9, dim=16)
    with pytest.raises(RuntimeError, match="key and value must be"):
        attention(query, key[:, :1], value[:, :1], None, 0.25)
    with pytest.raises(RuntimeError, match="the mask must be"):
        attention(query, key, value, torch.ones(2, 1, 2, 9, dtype=torch.bool), 0.25)
    with pytest.raises(RuntimeError, match="float32 CPU tensors"):
        attention(query.double(), key, value, None, 0.25)
