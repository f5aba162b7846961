"""The text perplexity is measured on, and measuring it with the shared harness of `quantlab.eval`.

The defaults (16 windows of 512 tokens of the bundled WikiText-2 slice, float32 compute) are those
of `benchmarks/quality.py` and the peer figures in `benchmarks/RESULTS.md`, so the figures the
workflows report compare with them.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantlab.errors import QuantlabError

BUNDLED_TEXT_NAME = "the bundled WikiText-2 text"


class EvaluationTextError(QuantlabError, ValueError):
    """An evaluation text that is missing, not UTF-8, or windows that cannot be scored."""


@dataclass(frozen=True)
class EvaluationText:
    """A text and the windows (`windows` x `seq_len` tokens) perplexity is measured on."""

    text: str
    source: str
    seq_len: int = 512
    windows: int = 16

    def describe(self) -> str:
        return f"{self.windows} x {self.seq_len} tokens of {self.source}"


def evaluation_text(path: str | os.PathLike | None = None, seq_len: int = 512, windows: int = 16) -> EvaluationText:
    """The UTF-8 text at `path`, or the WikiText-2 slice bundled with quantlab when `path` is None."""
    if seq_len < 2 or windows < 1:
        raise EvaluationTextError(
            f"evaluation windows need at least 2 tokens and at least 1 window (got {seq_len} and {windows})"
        )
    if path is None:
        from quantlab.assets.text import bundled_text

        return EvaluationText(bundled_text(), BUNDLED_TEXT_NAME, seq_len, windows)
    file = Path(path).expanduser()
    if not file.is_file():
        raise EvaluationTextError(f"--text {path}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise EvaluationTextError(f"--text {path} is not UTF-8 text ({error.reason} at byte {error.start})") from error
    return EvaluationText(text, str(file), seq_len, windows)


def measure_perplexity(model: Any, tokenizer: Any, text: EvaluationText, progress: bool = False) -> float:
    """Perplexity of an already loaded causal LM with the shared harness."""
    from quantlab.eval import perplexity

    return perplexity(model, tokenizer, text.text, seq_len=text.seq_len, windows=text.windows, progress=progress)


def reloaded_perplexity(folder: Path, text: EvaluationText, tokenizer: Any = None, progress: bool = False) -> float:
    """Load the checkpoint in `folder` in float32 (the harness's compute) and measure its perplexity."""
    import torch

    from quantlab.loading import open_model

    with open_model(folder) as opened:
        tokenizer = tokenizer if tokenizer is not None else opened.tokenizer()
        if tokenizer is None:
            raise QuantlabError(f"{folder} has no tokenizer, which perplexity needs; save one beside the model")
        model = opened.load(dtype=torch.float32)
    return measure_perplexity(model, tokenizer, text, progress)


def reloaded_embedding_cosines(folder: Path, reference: Path, text: EvaluationText, tokenizer: Any = None) -> Any:
    """Each evaluation line's cosine between the sentence embeddings of the encoder in `folder` and those of
    the encoder in `reference` (its float original), both loaded in float32: `[lines]`."""
    import torch

    from quantlab.eval.embeddings import embedding_cosines, evaluation_lines, sentence_embeddings
    from quantlab.loading import open_model

    lines = evaluation_lines(text.text)
    embeddings = []
    for source in (folder, reference):
        with open_model(source) as opened:
            tokenizer = tokenizer if tokenizer is not None else opened.tokenizer()
            if tokenizer is None:
                raise QuantlabError(f"{source} has no tokenizer, which embedding lines needs; save one beside it")
            model = opened.load(dtype=torch.float32)
        model.eval()
        embeddings.append(sentence_embeddings(model, tokenizer, lines))
        del model
    return embedding_cosines(*embeddings)


@dataclass(frozen=True)
class KVCacheMeasure:
    """Perplexity with chunked prefill through a KV cache, and what the cache held at the end of a window."""

    perplexity: float
    kv_bits: int | None  # None: a float cache (transformers' DynamicCache)
    chunk: int
    residual_length: int | None  # the quantized cache's float window; None for a float cache
    cache_bytes: int
    float32_bytes: int

    @property
    def ratio(self) -> float:
        """Bytes held over those of a float32 cache of the same length."""
        return self.cache_bytes / self.float32_bytes if self.float32_bytes else 1.0


def measure_kv_cache_perplexity(
    model: Any,
    tokenizer: Any,
    text: EvaluationText,
    kv_bits: int | None,
    chunk: int = 256,
    residual_length: int = 128,
    progress: bool = False,
) -> KVCacheMeasure:
    """Perplexity with each window prefilled `chunk` tokens at a time, later chunks reading the cache of the
    earlier ones: a `QuantizedKVCache` of `kv_bits` and `residual_length` (its defaults otherwise), or a
    float cache when `kv_bits` is None."""
    from transformers import DynamicCache

    from quantlab.eval.perplexity import chunked_window_losses, evaluation_windows, perplexity_of
    from quantlab.generation import QuantizedKVCache

    def new_cache() -> Any:
        if kv_bits is None:
            return DynamicCache(config=model.config)
        return QuantizedKVCache(model.config, bits=kv_bits, residual_length=residual_length)

    new_cache()  # an unsupported model or bits are refused before any work
    batches = evaluation_windows(tokenizer, text.text, text.seq_len, text.windows)
    losses, cache = chunked_window_losses(model, batches, chunk, new_cache, progress=progress)
    if kv_bits is None:
        held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        float32 = sum(4 * t.numel() for layer in cache.layers for t in (layer.keys, layer.values))
    else:
        held, float32 = cache.nbytes, cache.float_nbytes
    return KVCacheMeasure(
        perplexity_of(losses, text.seq_len), kv_bits, chunk, None if kv_bits is None else residual_length, held, float32
    )
