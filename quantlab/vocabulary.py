"""Quantizing a model's vocabulary tables: its input embedding and its output head (`embedding_bits`).

The tables are found the way transformers names them (`get_input_embeddings()`,
`get_output_embeddings()`); the head counts as tied when transformers' own tying map says so
(`all_tied_weights_keys`, which also holds on the meta device before weights are tied) or when
it shares the embedding's weight. A tied head becomes a `TiedOutputHead` reading the quantized
embedding, and is taken out of the tying map so transformers never assigns it a weight; an
untied head becomes a `QuantizedOutputHead`. Linear-layer quantization leaves the head alone
whenever `embedding_bits` is set.
"""

from dataclasses import dataclass

import torch
from torch import nn

from quantlab.config import QuantlabConfig
from quantlab.errors import QuantizationError
from quantlab.nn.quantized_embedding import QuantizedEmbedding, QuantizedOutputHead, TiedOutputHead


@dataclass(frozen=True)
class Vocabulary:
    """Names of a model's input embedding and output head (None: the model has none)."""

    embedding: str | None
    head: str | None
    tied: bool


def find_vocabulary(model: nn.Module) -> Vocabulary:
    """Where `model`'s input embedding and output head are, and whether the head is tied to it."""
    named = {id(module): name for name, module in model.named_modules()}
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding_name = named.get(id(embedding)) if embedding is not None else None
    head_name = named.get(id(head)) if head is not None else None
    return Vocabulary(embedding_name, head_name, _is_tied(model, embedding_name, head_name))


def _is_tied(model: nn.Module, embedding: str | None, head: str | None) -> bool:
    if embedding is None or head is None:
        return False
    head_module = model.get_submodule(head)
    if isinstance(head_module, TiedOutputHead):
        return True
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    if tied.get(f"{head}.weight") == f"{embedding}.weight":
        return True
    weight = getattr(head_module, "weight", None)
    return weight is not None and weight is getattr(model.get_submodule(embedding), "weight", None)


def vocabulary_linears(model: nn.Module, config: QuantlabConfig) -> set[str]:
    """Linear layers the Linear-layer pass must leave to `replace_vocabulary` (the output head)."""
    if config.embedding_bits is None:
        return set()
    head = find_vocabulary(model).head
    return {head} if head is not None else set()


def replace_vocabulary(model: nn.Module, config: QuantlabConfig, quantize: bool) -> list[str]:
    """Swap the input embedding (and the output head) for quantized ones when `config.embedding_bits` is set.

    With `quantize` false the new modules are empty shells on the old ones' device (meta while
    transformers loads); otherwise they are quantized from the float tables. Returns their names.
    """
    if config.embedding_bits is None:
        return []
    vocabulary = find_vocabulary(model)
    if vocabulary.embedding is None:
        raise QuantizationError(
            f"embedding_bits={config.embedding_bits} quantizes the input embeddings, but {type(model).__name__} "
            f"has none (no get_input_embeddings()); set embedding_bits=None"
        )
    embedding = model.get_submodule(vocabulary.embedding)
    if isinstance(embedding, QuantizedEmbedding):
        return []
    if type(embedding) is not nn.Embedding:
        raise QuantizationError(
            f"{vocabulary.embedding} is a {type(embedding).__name__}, not an nn.Embedding, so embedding_bits cannot "
            f"quantize it; set embedding_bits=None"
        )
    if quantize:
        table = QuantizedEmbedding.from_embedding(embedding, config, vocabulary.embedding)
    else:
        table = QuantizedEmbedding.like(embedding, config)
    converted = [vocabulary.embedding]
    if vocabulary.head is not None:
        head = model.get_submodule(vocabulary.head)
        new_head = _quantized_head(vocabulary, head, table, config, quantize)
        if new_head is not None:
            model.set_submodule(vocabulary.head, new_head)
            converted.append(vocabulary.head)
        if vocabulary.tied:
            # The head reads the embedding itself: `tie_weights` must neither give it a weight nor
            # look for one while loading.
            (getattr(model, "all_tied_weights_keys", None) or {}).pop(f"{vocabulary.head}.weight", None)
    model.set_submodule(vocabulary.embedding, table)
    return converted


def _quantized_head(
    vocabulary: Vocabulary, head: nn.Module, table: QuantizedEmbedding, config: QuantlabConfig, quantize: bool
) -> nn.Module | None:
    if vocabulary.tied:
        return TiedOutputHead(table, getattr(head, "bias", None))
    if type(head) is not nn.Linear:
        return None  # already quantized, or a layer quantlab does not handle: left as it is
    if quantize:
        return QuantizedOutputHead.from_linear(head, config, vocabulary.head)
    return QuantizedOutputHead.like(head, config)


def dequantize_vocabulary(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Float `nn.Embedding` and `nn.Linear` back in place of the quantized tables (a tied head tied again)."""
    embeddings: dict[int, nn.Embedding] = {}
    modules = list(model.named_modules())
    for name, module in modules:
        if isinstance(module, QuantizedEmbedding):
            embeddings[id(module)] = float_embedding = module.to_embedding(dtype)
            model.set_submodule(name, float_embedding)
        elif isinstance(module, QuantizedOutputHead):
            model.set_submodule(name, module.to_linear(dtype))
    for name, module in modules:
        if isinstance(module, TiedOutputHead):
            float_embedding = embeddings[id(module.embedding)]
            model.set_submodule(name, module.to_linear(float_embedding))
            vocabulary = find_vocabulary(model)
            tied = getattr(model, "all_tied_weights_keys", None)
            if tied is not None and vocabulary.embedding is not None:
                tied[f"{name}.weight"] = f"{vocabulary.embedding}.weight"
