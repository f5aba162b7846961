"""What the exporter traces: a model wrapped behind flat tensor inputs and outputs.

Causal LMs take `input_ids`, `attention_mask` and, with past key values,
`past_key_values.{i}.key/value` (`[batch, kv_heads, past_sequence_length, head_dim]`), and
return `logits` (and `present.{i}.key/value`). Position ids are computed inside the graph
from the attention mask, as `generate` does, so left-padded batches need nothing else.
Encoders take `input_ids`, `attention_mask` (and `token_type_ids` when the model has them)
and return every tensor of the model's output (`last_hidden_state`, `pooler_output`, ...).
"""

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from quantlab.export.onnx.errors import ExportError

CAUSAL_LM = "causal-lm"
ENCODER = "encoder"

BATCH = "batch_size"
SEQUENCE = "sequence_length"
PAST = "past_sequence_length"
TOTAL = "total_sequence_length"

# Example sizes for tracing: all different and > 1, so no dimension is specialized.
_EXAMPLE_BATCH, _EXAMPLE_SEQUENCE, _EXAMPLE_PAST = 2, 3, 4


@dataclass
class ExportSpec:
    """A traceable wrapper with its example inputs, names and dynamic axes."""

    kind: str
    wrapper: nn.Module
    args: tuple[torch.Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    dynamic_shapes: tuple  # per forward argument: {axis: name}; a tuple of them for `*past`
    metadata: dict[str, str] = field(default_factory=dict)


def model_kind(model: nn.Module) -> str:
    """`causal-lm` or `encoder`; anything else is refused with the reason."""
    if not isinstance(model, PreTrainedModel):
        raise ExportError(
            f"{type(model).__name__} is not a transformers PreTrainedModel; quantlab exports causal LMs and encoders "
            f"loaded with transformers"
        )
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ExportError(
            f"{type(model).__name__}: encoder-decoder models are not supported by quantlab's ONNX export; "
            f"export a decoder-only causal LM or an encoder"
        )
    if model.can_generate():
        return CAUSAL_LM
    if "input_ids" not in inspect.signature(model.forward).parameters:
        raise ExportError(
            f"{type(model).__name__}: its forward takes no input_ids; quantlab exports text models "
            f"(causal LMs and encoders)"
        )
    return ENCODER


def build_spec(model: PreTrainedModel, with_past: bool) -> ExportSpec:
    kind = model_kind(model)
    if kind == ENCODER:
        if with_past:
            raise ExportError(f"{type(model).__name__} is an encoder: with_past only applies to causal LMs")
        return _encoder_spec(model)
    return _causal_lm_spec(model, with_past)


def _example_ids(model: PreTrainedModel, batch: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    vocab = min(int(getattr(model.config, "vocab_size", 100) or 100), 100)
    return torch.randint(0, vocab, (batch, length), generator=generator)


def _takes(model: nn.Module, argument: str) -> bool:
    return argument in inspect.signature(model.forward).parameters


# -- causal LMs ------------------------------------------------------------------------------


class CausalLMForExport(nn.Module):
    def __init__(self, model: PreTrainedModel, with_past: bool) -> None:
        super().__init__()
        self.model = model
        self.with_past = with_past
        self.position_ids = _takes(model, "position_ids")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *past: torch.Tensor):
        kwargs: dict[str, Any] = {}
        if self.position_ids:
            positions = attention_mask.long().cumsum(-1) - 1
            positions = positions.masked_fill(attention_mask == 0, 1)
            kwargs["position_ids"] = positions[:, -input_ids.shape[1] :]
        if not self.with_past:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
        cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2], strict=True)), config=self.model.config)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True, **kwargs
        )
        return (out.logits, *flatten_cache(out.past_key_values))


def flatten_cache(cache: Any) -> list[torch.Tensor]:
    """`[key_0, value_0, key_1, ...]` of a transformers cache whose layers hold keys and values."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ExportError(
            f"the model returned a {type(cache).__name__} cache; quantlab exports past key values of "
            f"transformers Cache objects with key/value layers only"
        )
    flat = []
    for index, layer in enumerate(layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.dim() != 4:
            raise ExportError(
                f"cache layer {index} ({type(layer).__name__}) holds no [batch, heads, sequence, head_dim] "
                f"keys/values; this architecture cannot be exported with past key values, use with_past=False"
            )
        flat += [keys, values]
    return flat


def _causal_lm_spec(model: PreTrainedModel, with_past: bool) -> ExportSpec:
    batch, sequence, past = _EXAMPLE_BATCH, _EXAMPLE_SEQUENCE, _EXAMPLE_PAST
    wrapper = CausalLMForExport(model, with_past)
    metadata = {"quantlab.kind": CAUSAL_LM, "quantlab.with_past": str(int(with_past))}
    if not with_past:
        ids = _example_ids(model, batch, sequence)
        return ExportSpec(
            kind=CAUSAL_LM,
            wrapper=wrapper,
            args=(ids, torch.ones_like(ids)),
            input_names=["input_ids", "attention_mask"],
            output_names=["logits"],
            dynamic_shapes=({0: BATCH, 1: SEQUENCE}, {0: BATCH, 1: SEQUENCE}),
            metadata=metadata,
        )
    # The cache layout (layers, kv heads, head dim) is read from one eager step of the model.
    with torch.no_grad():
        prompt = _example_ids(model, batch, past)
        cache = model(input_ids=prompt, attention_mask=torch.ones_like(prompt), use_cache=True).past_key_values
    past_values = [t.detach().clone() for t in flatten_cache(cache)]
    layers = len(past_values) // 2
    ids = _example_ids(model, batch, sequence)
    kv_names = [f"{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    past_axes = {0: BATCH, 2: PAST}
    return ExportSpec(
        kind=CAUSAL_LM,
        wrapper=wrapper,
        args=(ids, torch.ones(batch, past + sequence, dtype=torch.long), *past_values),
        input_names=["input_ids", "attention_mask"] + [f"past_key_values.{name}" for name in kv_names],
        output_names=["logits"] + [f"present.{name}" for name in kv_names],
        dynamic_shapes=({0: BATCH, 1: SEQUENCE}, {0: BATCH, 1: TOTAL}, tuple([past_axes] * len(past_values))),
        metadata=metadata,
    )


# -- encoders ------------------------------------------------------------------------------


class EncoderForExport(nn.Module):
    def __init__(self, model: PreTrainedModel, input_names: list[str], output_names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.input_names = input_names
        self.output_names = output_names

    def forward(self, *inputs: torch.Tensor):
        out = self.model(**dict(zip(self.input_names, inputs, strict=True)), return_dict=True)
        return tuple(out[name] for name in self.output_names)


def _encoder_spec(model: PreTrainedModel) -> ExportSpec:
    ids = _example_ids(model, _EXAMPLE_BATCH, _EXAMPLE_SEQUENCE + 2)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if _takes(model, "token_type_ids"):
        inputs["token_type_ids"] = torch.zeros_like(ids)
    with torch.no_grad():
        out = model(**inputs, return_dict=True)
    output_names = [name for name, value in out.items() if isinstance(value, torch.Tensor)]
    if not output_names:
        raise ExportError(f"{type(model).__name__} returned no tensor output to export")
    input_names = list(inputs)
    return ExportSpec(
        kind=ENCODER,
        wrapper=EncoderForExport(model, input_names, output_names),
        args=tuple(inputs.values()),
        input_names=input_names,
        output_names=output_names,
        dynamic_shapes=(tuple({0: BATCH, 1: SEQUENCE} for _ in input_names),),  # one `*inputs` argument
        metadata={"quantlab.kind": ENCODER},
    )
