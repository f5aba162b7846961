"""A lean decoding loop for the native step, behind `model.generate`.

With the native step a token's work is one call into C, and transformers' `_sample` loop around it
adds a sizeable share on top (benchmarks/RESULTS.md): preparing the step's inputs, updating its
keyword arguments and masks, building an output object, a dozen small tensor ops. For one sequence
on the native step most of that does nothing, so `native_sample` runs the same loop without it: the
same prefill (`_prefill`), the same logits processors and stopping criteria built by `generate`, the
same token choice (argmax, or softmax and `torch.multinomial`), the same outputs
(`return_dict_in_generate`, `output_scores`, `output_logits`, the cache): the tokens and scores
equal `_sample`'s bit for bit (tested).

`NativeGenerate` is the model's `generate` while the native step is installed: transformers'
`generate`, given `custom_generate=native_sample` (transformers' own hook for a decoding loop) when
the call is one it applies to: one sequence, greedy or sampling, no streamer, assistant model or
other option that `custom_generate` would drop. Every other call is transformers' `generate` as is,
and `native_sample` hands what it does not take (several sequences, padding, attentions or hidden
states asked for) to transformers' `_sample`.
"""

from typing import Any

import torch
from transformers import Cache, StaticCache
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.configuration_utils import GenerationMode

from quantlab.generation.kv_cache import QuantizedKVCache
from quantlab.generation.native import NativeDecodeStep

_LEAN_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
# Arguments of generate that custom_generate would drop or that change the loop: such calls keep _sample.
_NOT_LEAN = ("streamer", "assistant_model", "synced_gpus", "custom_generate", "prefix_allowed_tokens_fn")
_NOT_LEAN += ("negative_prompt_ids", "tokenizer", "assistant_tokenizer", "inputs_embeds", "use_model_defaults")
# model_kwargs the lean loop knows what to do with; any other key goes to _sample.
# (position_ids: generate's positions of the prompt, 0..n-1 when the mask is all ones, as checked.)
_LEAN_MODEL_KWARGS = frozenset({"attention_mask", "past_key_values", "use_cache", "logits_to_keep", "position_ids"})


class NativeGenerate:
    """`model.generate` with the native step installed (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, inputs: torch.Tensor | None = None, generation_config: Any = None, **kwargs: Any) -> Any:
        generate = type(self.model).generate
        if self._lean(inputs, generation_config, kwargs):
            kwargs["custom_generate"] = native_sample
        return generate(self.model, inputs, generation_config, **kwargs)

    def _lean(self, inputs: Any, generation_config: Any, kwargs: dict) -> bool:
        if any(kwargs.get(name) is not None for name in _NOT_LEAN):
            return False
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
            return False
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return False  # generate may sync processes (synced_gpus), which custom_generate drops
        config, _ = self.model._prepare_generation_config(generation_config, **dict(kwargs))
        return config.get_generation_mode() in _LEAN_MODES and config.num_return_sequences in (None, 1)


def native_sample(
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    **model_kwargs: Any,
) -> Any:
    """transformers' `_sample` (greedy or sampling) for one sequence on the native step, without the
    per-step bookkeeping it does not need; other cases run transformers' `_sample` itself."""
    step = getattr(model, "_compiled_call", None)
    if not _applies(model, step, input_ids, generation_config, model_kwargs):
        return type(model)._sample(
            model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs
        )  # fmt: skip
    step.lean_loops += 1
    decoder = step.decoder
    cache = model_kwargs["past_key_values"]
    config = generation_config
    keep_scores = config.return_dict_in_generate and config.output_scores
    keep_logits = config.return_dict_in_generate and config.output_logits
    scores: tuple | None = () if keep_scores else None
    raw_logits: tuple | None = () if keep_logits else None
    outputs = model._prefill(input_ids, config, model_kwargs, is_first_iteration=True)
    logits = outputs.logits[:, -1]
    del outputs
    while True:
        next_token_logits = logits.to(copy=True, dtype=torch.float32)
        next_token_scores = logits_processor(input_ids, next_token_logits)
        if keep_scores:
            scores += (next_token_scores,)
        if keep_logits:
            raw_logits += (next_token_logits,)
        if config.do_sample:
            probabilities = torch.nn.functional.softmax(next_token_scores, dim=-1)
            next_tokens = torch.multinomial(probabilities, num_samples=1).squeeze(1)
        else:
            next_tokens = decoder.greedy_tokens(next_token_scores)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        if stopping_criteria(input_ids, scores).any():
            break
        with torch.no_grad():
            logits = decoder.step(next_tokens[:, None], cache, None)[:, -1]
        step.native_steps += 1
    if config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits, past_key_values=cache)
    return input_ids


def _applies(model: Any, step: Any, input_ids: torch.Tensor, config: Any, model_kwargs: dict) -> bool:
    """True when every step of this call after the prompt is one the native step takes."""
    if not isinstance(step, NativeDecodeStep) or input_ids.shape[0] != 1 or not hasattr(model, "_prefill"):
        return False
    if config.output_attentions or config.output_hidden_states or getattr(config, "is_assistant", False):
        return False
    if set(model_kwargs) - _LEAN_MODEL_KWARGS:
        return False
    cache = model_kwargs.get("past_key_values")
    if isinstance(cache, QuantizedKVCache):
        if not step.decoder.can_read_quantized_cache(cache):
            return False
    elif not isinstance(cache, StaticCache) or not model._valid_auto_compile_criteria(model_kwargs, config):
        return False
    elif getattr(model, "_last_compile_config", None) != config.compile_config:
        return False  # generate would compile a step of its own for this config, not take the native one
    mask = model_kwargs.get("attention_mask")
    return mask is None or bool(mask.all())


class NativeCachePreparation:
    """The model's `_prepare_cache_for_generation` while the native step is installed: a cache passed to
    `generate` (a QuantizedKVCache, a static cache filled before) is taken as it is (transformers refuses
    any cache beside the static cache implementation `compile_for_decoding` sets), and with `kv_bits`
    every generation without a cache of its own gets a QuantizedKVCache of that many bits, allocated for
    the longer of `capacity` and the generation. Everything else is transformers' business."""

    def __init__(self, model: Any, kv_bits: int | None, capacity: int) -> None:
        self.model = model
        self.kv_bits = kv_bits
        self.capacity = capacity

    def __call__(
        self, generation_config: Any, model_kwargs: dict, generation_mode: Any, batch_size: int, max_cache_length: int
    ) -> None:
        cache = model_kwargs.get("past_key_values")
        if isinstance(cache, Cache):
            cache._is_user_defined = True  # generate returns it, as it returns any cache passed in
            return
        if cache is None and self.kv_bits is not None and generation_config.use_cache is not False:
            capacity = max(self.capacity, max_cache_length)
            model_kwargs["past_key_values"] = QuantizedKVCache(self.model.config, bits=self.kv_bits, capacity=capacity)
            return
        type(self.model)._prepare_cache_for_generation(
            self.model, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
