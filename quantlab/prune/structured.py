"""Structured pruning: remove whole MLP neurons and attention heads, so the matrices really shrink.

For Llama-style decoders (Llama, Mistral, Qwen2, SmolLM2: gated MLP `gate_proj`/`up_proj`/
`down_proj`, attention `q_proj`/`k_proj`/`v_proj`/`o_proj`). Removing neuron `j` deletes row
`j` of `gate_proj` and `up_proj` and column `j` of `down_proj`; removing a query head deletes
its `head_dim` rows of `q_proj` and columns of `o_proj`. The pruned model computes exactly
what the original computes with those neurons' and heads' outputs set to zero, in smaller,
faster matrix products.

Every layer loses the same number of neurons (and of query heads per key/value head, so
grouped-query attention keeps equal groups); each layer chooses its own, least important,
ones. A Llama config has one `intermediate_size` and one `num_attention_heads` for all layers,
so this uniform shape is what it can express: the pruned model is an ordinary, smaller model of
the same class whose `config.json` states the new sizes (`head_dim` is pinned, as it no longer
equals `hidden_size / num_attention_heads`); `save_pretrained` / `from_pretrained` and
quantization work on it unchanged, without quantlab. Non-uniform allocations (more pruning in
some layers) would need per-layer sizes the config has no field for, and are not offered.

Importance: without calibration data, the product of the L2 norms of what a unit reads and
writes (`||gate_j|| * ||up_j|| * ||down_:,j||`; for a head `||q_h||_F * ||o_:,h||_F`). With
calibration batches, the root-mean-square of the unit's actual output feeding the next
projection, times the norm of the weights it feeds (`rms(a_j) * ||down_:,j||`), the structured
form of Wanda (arXiv 2306.11695) and FLAP (arXiv 2312.11983): units that are large but rarely
active are told apart from units that carry the signal.
"""

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from quantlab.nn import QuantizedLinear
from quantlab.prune.layer_masks import attach_mask, mask_of
from quantlab.prune.patterns import PruningError, check_sparsity

_MLP = ("gate_proj", "up_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclasses.dataclass
class StructuredResult:
    """Sizes before and after, and the parameter count of the pruned layers."""

    intermediate_size: tuple[int, int]
    attention_heads: tuple[int, int]
    key_value_heads: tuple[int, int]
    parameters: tuple[int, int]

    @property
    def neuron_sparsity(self) -> float:
        before, after = self.intermediate_size
        return 1 - after / before

    @property
    def head_sparsity(self) -> float:
        before, after = self.attention_heads
        return 1 - after / before


@dataclasses.dataclass
class _Block:
    """One decoder layer's MLP and attention modules."""

    name: str
    mlp: nn.Module
    attention: nn.Module


def prune_structured(
    model: nn.Module,
    mlp_sparsity: float = 0.0,
    head_sparsity: float = 0.0,
    calibration: Iterable[dict[str, torch.Tensor]] | None = None,
) -> StructuredResult:
    """Remove `mlp_sparsity` of every layer's MLP neurons and `head_sparsity` of its query heads, in place.

    `calibration`: batches (`{"input_ids": ..., "attention_mask": ...}`) to score units by
    their activations; without it, by weight norms. With grouped-query attention the same
    number of query heads goes from every key/value group (`round(head_sparsity * group)`);
    with one query head per key/value head, whole key/value heads go.
    """
    check_sparsity(mlp_sparsity, "mlp_sparsity")
    check_sparsity(head_sparsity, "head_sparsity")
    config = getattr(model, "config", None)
    blocks = decoder_blocks(model)
    parameters_before = _parameters(blocks)
    activations = _calibration_activations(model, blocks, calibration) if calibration is not None else None
    before = _sizes(config, blocks)
    if mlp_sparsity > 0:
        keep = before[0] - round(mlp_sparsity * before[0])
        if keep < 1:
            raise PruningError(f"mlp_sparsity={mlp_sparsity} would remove every MLP neuron; use a lower value")
        for block in blocks:
            _prune_neurons(block, _neuron_scores(block, activations), keep)
    if head_sparsity > 0:
        _prune_heads(config, blocks, head_sparsity, activations)
    _update_config(config, blocks)
    check_config_matches(model)
    after = _sizes(config, blocks)
    return StructuredResult(
        intermediate_size=(before[0], after[0]),
        attention_heads=(before[1], after[1]),
        key_value_heads=(before[2], after[2]),
        parameters=(parameters_before, _parameters(blocks)),
    )


def decoder_blocks(model: nn.Module) -> list[_Block]:
    """The decoder layers with a gated MLP and q/k/v/o attention; anything else is refused by name."""
    blocks = []
    for name, module in model.named_modules():
        mlp, attention = getattr(module, "mlp", None), getattr(module, "self_attn", None)
        if mlp is None or attention is None:
            continue
        if not all(isinstance(getattr(mlp, p, None), nn.Module) for p in _MLP) or not all(
            isinstance(getattr(attention, p, None), nn.Module) for p in _ATTENTION
        ):
            raise PruningError(
                f"{name}: structured pruning supports Llama-style decoders (MLP with gate_proj/up_proj/down_proj, "
                f"attention with q_proj/k_proj/v_proj/o_proj); {type(module).__name__} is laid out otherwise"
            )
        for part, names in ((mlp, _MLP), (attention, _ATTENTION)):
            for projection in names:
                _check_linear(f"{name}.{projection}", getattr(part, projection))
        blocks.append(_Block(name, mlp, attention))
    if not blocks:
        raise PruningError(
            f"{type(model).__name__} has no decoder layer with `mlp` and `self_attn`: structured pruning supports "
            f"Llama-style decoders (Llama, Mistral, Qwen2, SmolLM2)"
        )
    return blocks


def _check_linear(name: str, module: nn.Module) -> None:
    if isinstance(module, QuantizedLinear):
        raise PruningError(f"{name} is quantized; prune the float model first, then quantize the smaller model")
    if type(module) is not nn.Linear:
        raise PruningError(
            f"{name} is a {type(module).__name__}, not an nn.Linear: prune before adding adapters or other wrappers"
        )


# -- importance -------------------------------------------------------------------------------


def _neuron_scores(block: _Block, activations: dict[str, torch.Tensor] | None) -> torch.Tensor:
    mlp = block.mlp
    down = mlp.down_proj.weight.detach().float().norm(dim=0)
    if activations is not None:
        return activations[f"{block.name}.mlp.down_proj"].sqrt() * down
    gate = mlp.gate_proj.weight.detach().float().norm(dim=1)
    up = mlp.up_proj.weight.detach().float().norm(dim=1)
    return gate * up * down


def _head_scores(block: _Block, head_dim: int, activations: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """One score per query head."""
    attention = block.attention
    out = attention.o_proj.weight.detach().float()
    out_norm = out.pow(2).reshape(out.shape[0], -1, head_dim).sum(dim=(0, 2)).sqrt()
    if activations is not None:
        rms = activations[f"{block.name}.self_attn.o_proj"].reshape(-1, head_dim).sum(-1).sqrt()
        return rms * out_norm
    query = attention.q_proj.weight.detach().float()
    query_norm = query.pow(2).reshape(-1, head_dim, query.shape[1]).sum(dim=(1, 2)).sqrt()
    return query_norm * out_norm


def _calibration_activations(
    model: nn.Module, blocks: list[_Block], batches: Iterable[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Mean square of each input feature of every `down_proj` and `o_proj`, over the calibration tokens."""
    sums: dict[str, torch.Tensor] = {}
    tokens = torch.zeros((), dtype=torch.float64)
    hooks = []

    def recorder(name: str):
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
            squares = x.pow(2).sum(0).double().cpu()
            sums[name] = sums[name] + squares if name in sums else squares

        return record

    for block in blocks:
        hooks.append(block.mlp.down_proj.register_forward_pre_hook(recorder(f"{block.name}.mlp.down_proj")))
        hooks.append(block.attention.o_proj.register_forward_pre_hook(recorder(f"{block.name}.self_attn.o_proj")))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for batch in batches:
                batch = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
                model(**batch)
                mask = batch.get("attention_mask")
                tokens += batch["input_ids"].numel() if mask is None else int(mask.sum())
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    if not tokens:
        raise PruningError("the calibration batches hold no tokens; pass some text or calibration=None")
    return {name: (total / tokens).float() for name, total in sums.items()}


# -- removal ------------------------------------------------------------------------------------


def _prune_neurons(block: _Block, scores: torch.Tensor, keep: int) -> None:
    kept = torch.topk(scores, keep).indices.sort().values
    mlp = block.mlp
    mlp.gate_proj = _select_rows(mlp.gate_proj, kept)
    mlp.up_proj = _select_rows(mlp.up_proj, kept)
    mlp.down_proj = _select_columns(mlp.down_proj, kept)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = keep


def _prune_heads(config, blocks: list[_Block], sparsity: float, activations) -> None:
    head_dim = _head_dim(config, blocks[0])
    heads = blocks[0].attention.q_proj.out_features // head_dim
    kv_heads = blocks[0].attention.k_proj.out_features // head_dim
    group = heads // kv_heads
    whole_groups = group == 1
    units = kv_heads if whole_groups else group
    removed = round(sparsity * units)
    if removed == 0:
        raise PruningError(
            f"head_sparsity={sparsity} removes no head: with {heads} query heads in {kv_heads} key/value groups, "
            f"the smallest step is {1 / units:.3g}"
        )
    if removed >= units:
        raise PruningError(f"head_sparsity={sparsity} would remove every attention head; use a lower value")
    for block in blocks:
        scores = _head_scores(block, head_dim, activations).reshape(kv_heads, group)
        if whole_groups:
            kept_groups = torch.topk(scores.sum(1), kv_heads - removed).indices.sort().values
            kept_heads = kept_groups
            _select_kv_heads(block.attention, kept_groups, head_dim)
        else:
            kept_in_group = torch.topk(scores, group - removed, dim=1).indices.sort(dim=1).values
            kept_heads = (kept_in_group + torch.arange(kv_heads).unsqueeze(1) * group).reshape(-1)
        rows = (kept_heads.unsqueeze(1) * head_dim + torch.arange(head_dim)).reshape(-1)
        attention = block.attention
        attention.q_proj = _select_rows(attention.q_proj, rows)
        attention.o_proj = _select_columns(attention.o_proj, rows)
        new_kv = attention.k_proj.out_features // head_dim
        attention.num_key_value_groups = attention.q_proj.out_features // head_dim // new_kv


def _select_kv_heads(attention: nn.Module, kept: torch.Tensor, head_dim: int) -> None:
    rows = (kept.unsqueeze(1) * head_dim + torch.arange(head_dim)).reshape(-1)
    attention.k_proj = _select_rows(attention.k_proj, rows)
    attention.v_proj = _select_rows(attention.v_proj, rows)


def _select_rows(layer: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A new Linear with only `rows` of the output features (weights copied, memory released)."""
    rows = rows.to(layer.weight.device)
    new = _like(layer, layer.in_features, len(rows))
    with torch.no_grad():
        new.weight.copy_(layer.weight.index_select(0, rows))
        if layer.bias is not None:
            new.bias.copy_(layer.bias.index_select(0, rows))
    mask = mask_of(layer)
    if mask is not None:
        attach_mask(new, mask.index_select(0, rows))
    return new


def _select_columns(layer: nn.Linear, columns: torch.Tensor) -> nn.Linear:
    columns = columns.to(layer.weight.device)
    new = _like(layer, len(columns), layer.out_features)
    with torch.no_grad():
        new.weight.copy_(layer.weight.index_select(1, columns))
        if layer.bias is not None:
            new.bias.copy_(layer.bias)
    mask = mask_of(layer)
    if mask is not None:
        attach_mask(new, mask.index_select(1, columns))
    return new


def _like(layer: nn.Linear, in_features: int, out_features: int) -> nn.Linear:
    weight = layer.weight
    new = nn.Linear(in_features, out_features, bias=layer.bias is not None, device=weight.device, dtype=weight.dtype)
    new.train(layer.training)
    new.weight.requires_grad_(weight.requires_grad)
    return new


# -- config -------------------------------------------------------------------------------------


def _head_dim(config, block: _Block) -> int:
    head_dim = getattr(block.attention, "head_dim", None) or getattr(config, "head_dim", None)
    if not head_dim:
        raise PruningError(f"{block.name}: cannot tell the attention head size (no head_dim on the module or config)")
    return int(head_dim)


def _sizes(config, blocks: list[_Block]) -> tuple[int, int, int]:
    first = blocks[0]
    head_dim = _head_dim(config, first)
    return (
        first.mlp.gate_proj.out_features,
        first.attention.q_proj.out_features // head_dim,
        first.attention.k_proj.out_features // head_dim,
    )


def _update_config(config, blocks: list[_Block]) -> None:
    """Write the new sizes into the model's config, and check that the config now builds this very model."""
    if config is None:
        return
    intermediate, heads, kv_heads = _sizes(config, blocks)
    config.head_dim = _head_dim(config, blocks[0])
    config.intermediate_size = intermediate
    config.num_attention_heads = heads
    config.num_key_value_heads = kv_heads


def _parameters(blocks: list[_Block]) -> int:
    return sum(p.numel() for block in blocks for part in (block.mlp, block.attention) for p in part.parameters())


def check_config_matches(model: nn.Module) -> None:
    """Build the model's class from its config on the meta device and compare every weight's shape.

    Confirms that `save_pretrained` → `from_pretrained` reproduces the pruned shapes.
    """
    config = getattr(model, "config", None)
    if config is None:
        return
    with torch.device("meta"):
        rebuilt = type(model)(config)
    expected = {name: tuple(t.shape) for name, t in rebuilt.state_dict().items()}
    actual = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wrong = [name for name in actual if name in expected and expected[name] != actual[name]]
    if wrong:
        raise PruningError(
            f"{type(model).__name__}'s config cannot express the pruned shapes (e.g. {wrong[0]}: model "
            f"{actual[wrong[0]]}, config builds {expected[wrong[0]]}); this architecture is not supported"
        )
