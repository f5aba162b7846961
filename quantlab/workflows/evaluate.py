"""Perplexity, size on disk and stored bits per parameter of a checkpoint (quantized or float) or GGUF file.

The model is loaded in float32 compute, as the shared harness (and `benchmarks/quality.py`) does.
With `kv_bits` (or `kv_chunk`) each window is prefilled in chunks through a quantized (or float)
KV cache, so that later chunks read the cache's states of the earlier ones.
"""

import os
import time
from dataclasses import dataclass, field

from quantlab.errors import QuantlabError
from quantlab.loading import ModelSource, open_model, weights_size
from quantlab.workflows.text import EvaluationText, evaluation_text, measure_kv_cache_perplexity, measure_perplexity

DEFAULT_KV_CHUNK = 256
DEFAULT_KV_RESIDUAL = 128


@dataclass
class EvalReport:
    """What `evaluate_checkpoint` measured."""

    model: str
    quantization: str | None
    perplexity: float
    evaluation_text: str
    tokens: int
    parameters: int
    bits_per_quantized_weight: float | None
    bits_per_parameter: float
    size_bytes: int
    layers_quantized: int
    layers_kept: int
    load_seconds: float
    evaluate_seconds: float
    tables_quantized: list[str] = field(default_factory=list)
    kv_bits: int | None = None  # bits of the quantized KV cache; None: float cache (or no cache)
    kv_chunk: int | None = None  # prefill chunk in tokens; None: one forward per window, no cache
    kv_residual: int | None = None  # float window of the quantized KV cache, in tokens
    kv_cache_bytes: int | None = None  # held by the cache at the end of a window
    kv_cache_ratio: float | None = None  # kv_cache_bytes over a float32 cache of the same length


def evaluate_checkpoint(
    model: "str | os.PathLike | ModelSource",
    text: EvaluationText | None = None,
    *,
    progress: bool = False,
    kv_bits: int | None = None,
    kv_chunk: int | None = None,
    kv_residual: int | None = None,
) -> EvalReport:
    """Perplexity of the causal LM at `model` on `text` (default: the bundled text, 16 x 512 tokens).

    `kv_bits` (8 or 4): prefill each window `kv_chunk` tokens at a time (default 256) through a
    `QuantizedKVCache` whose float window holds `kv_residual` tokens (default 128); `kv_chunk`
    alone: the same chunked pass through a float cache.
    """
    import torch

    from quantlab.eval.size import stored_bits_per_weight
    from quantlab.workflows.stats import layer_summary, parameter_count

    text = text if text is not None else evaluation_text()
    started = time.perf_counter()
    with open_model(model, progress=progress) as opened:
        source = opened.source
        if not opened.is_causal_lm:
            raise QuantlabError(
                f"perplexity needs a causal language model, but {source} is a {opened.model_class.__name__}"
            )
        tokenizer = opened.tokenizer()
        if tokenizer is None:
            raise QuantlabError(f"{source} has no tokenizer, which perplexity needs; save one beside the model")
        loaded_model = opened.load(dtype=torch.float32)
        quantization = opened.quantization
    loaded = time.perf_counter()
    kv = None
    if kv_bits is not None or kv_chunk is not None:
        chunk = kv_chunk if kv_chunk is not None else DEFAULT_KV_CHUNK
        residual = kv_residual if kv_residual is not None else DEFAULT_KV_RESIDUAL
        kv = measure_kv_cache_perplexity(loaded_model, tokenizer, text, kv_bits, chunk, residual, progress)
        value = kv.perplexity
    else:
        value = measure_perplexity(loaded_model, tokenizer, text, progress)
    layers = layer_summary(loaded_model)
    parameters, size = parameter_count(loaded_model), weights_size(source.path)
    return EvalReport(
        model=str(source),
        quantization=quantization,
        perplexity=value,
        evaluation_text=text.describe(),
        tokens=text.windows * text.seq_len,
        parameters=parameters,
        bits_per_quantized_weight=stored_bits_per_weight(loaded_model) if layers.quantized else None,
        bits_per_parameter=8 * size / parameters,
        size_bytes=size,
        layers_quantized=len(layers.quantized),
        layers_kept=len(layers.kept),
        load_seconds=loaded - started,
        evaluate_seconds=time.perf_counter() - loaded,
        tables_quantized=layers.tables,
        kv_bits=kv_bits,
        kv_chunk=kv.chunk if kv else None,
        kv_residual=kv.residual_length if kv else None,
        kv_cache_bytes=kv.cache_bytes if kv else None,
        kv_cache_ratio=kv.ratio if kv else None,
    )
