"""Attention for the compiled decode step: one-token queries of grouped-query attention read the cache's
key/value heads as they are.

transformers' SDPA attention repeats every key/value head for the query heads that share it
(`repeat_kv`) whenever the step is being compiled (its copy-free packing is skipped under dynamo), and
with a static cache that copies the whole cache, used positions or not, at every step of every layer, a
sizeable share of a decode step (benchmarks/RESULTS.md). A one-token query of head group g can instead
be laid out as `groups` query rows of key/value head g (query [batch, heads, 1, dim] -> [batch,
kv_heads, groups, dim]): the same attention, the cache read in place. The step's mask ([batch, 1, 1,
length]) is the same for every head and row, so it broadcasts unchanged. Where quantlab's native kernels
are built, that attention runs in C (`quantlab::attention`, csrc/attention.c), which skips the cache's
unused positions: torch's CPU attention spends more on per-head setup than on the arithmetic of
one-token queries.

Only attention modules `use_grouped_query_sdpa` marked (`compile_for_decoding` marks a model whose
attention is "sdpa"; `disable_compiled_decoding` unmarks it) take that route, and only for one-token
queries; everything else (other models, prompts, paged caches, masks per head, position biases) goes to
the function registered as "sdpa" before, transformers' own. The model keeps "sdpa" as its attention
implementation, so continuous batching, saving and PEFT see no change.
"""

from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface

from quantlab.kernels.cpu import ops

ONE_TOKEN_GQA = "_quantlab_one_token_gqa"  # set on the attention modules that take the copy-free route
_plain_sdpa: Callable | None = None  # the "sdpa" attention grouped_query_sdpa took the place of


def grouped_query_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (same arguments and output: [batch, query length, heads, dim]);
    on marked modules, one-token queries of grouped-query attention run on the key/value heads."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, _ = query.shape
    plain = (
        not getattr(module, ONE_TOKEN_GQA, False)
        or groups == 1
        or length != 1
        or key.shape[1] * groups != heads  # keys already repeated per query head
        or any(kwargs.get(name) is not None for name in ("cache", "position_bias", "softcap"))
        or kwargs.get("output_attentions", False)
        or (attention_mask is not None and attention_mask.shape[1] != 1)
    )
    if plain:
        return _plain_sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    packed = query.reshape(batch, heads // groups, groups, query.shape[-1])
    if _native_attention(packed, key, value, attention_mask, dropout):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        output = ops.attention_op(packed, key, value, attention_mask, scale)
    else:
        output = torch.nn.functional.scaled_dot_product_attention(
            packed, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
        )
    return output.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _native_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, dropout: float
) -> bool:
    """Whether `quantlab::attention` (C, csrc/attention.c) takes a packed one-token query: float32 CPU tensors,
    no dropout, no gradient asked for (it has no autograd formula), a mask of one row per sequence, and
    the native kernels built here."""
    tensors = (query, key, value)
    return (
        dropout == 0.0
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and (mask is None or _one_row_per_sequence(mask, query.shape[0], key.shape[2]))
        and ops.available()
    )


def _one_row_per_sequence(mask: torch.Tensor, batch: int, length: int) -> bool:
    """A mask `quantlab::attention` takes: [batch or 1, 1, 1, length] (other shapes go to SDPA, which broadcasts)."""
    return mask.dim() == 4 and mask.shape[0] in (1, batch) and tuple(mask.shape[1:]) == (1, 1, length)


def _register() -> None:
    """Put grouped_query_sdpa in transformers' registry as "sdpa", once, keeping what was there."""
    global _plain_sdpa
    current = AttentionInterface._global_mapping["sdpa"]
    if current is not grouped_query_sdpa:
        _plain_sdpa = current
        AttentionInterface.register("sdpa", grouped_query_sdpa)


def use_grouped_query_sdpa(model: Any) -> None:
    """Mark the grouped-query attention modules of a model on "sdpa" attention (others are left alone)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    _register()
    for module in model.modules():
        if getattr(module, "num_key_value_groups", 1) > 1:
            setattr(module, ONE_TOKEN_GQA, True)


def stop_grouped_query_sdpa(model: Any) -> None:
    """Undo `use_grouped_query_sdpa`: the model's layers take transformers' "sdpa" attention again."""
    for module in model.modules():
        module.__dict__.pop(ONE_TOKEN_GQA, None)
