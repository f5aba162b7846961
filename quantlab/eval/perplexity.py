"""Perplexity with the shared harness, so figures compare across tools (benchmarks/RESULTS.md).

Tokenize the whole text with the model's tokenizer (special tokens as the tokenizer adds them,
no extra BOS), cut the ids into consecutive non-overlapping windows of `seq_len`, score the
first `windows` of them with `model(x, labels=x)`, and report
`exp(sum(loss_i * (seq_len - 1)) / (windows * (seq_len - 1)))`: each window's mean loss covers
its `seq_len - 1` predicted tokens. The fp32 reference of SmolLM2-135M is in benchmarks/RESULTS.md.
"""

import contextlib
import math
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional

from quantlab.errors import QuantlabError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def perplexity(
    model: nn.Module,
    tokenizer: "PreTrainedTokenizerBase",
    text: str,
    seq_len: int = 512,
    windows: int = 16,
    progress: bool = False,
) -> float:
    """Perplexity of a causal LM on the first `windows` windows of `seq_len` tokens of `text`."""
    batches = evaluation_windows(tokenizer, text, seq_len, windows)
    return perplexity_of(window_losses(model, batches, progress=progress), seq_len)


def perplexity_of(losses: list[float], seq_len: int) -> float:
    """`exp` of the mean loss over every predicted token of windows of `seq_len` tokens with mean losses `losses`."""
    predicted = seq_len - 1
    return math.exp(sum(loss * predicted for loss in losses) / (len(losses) * predicted))


def evaluation_windows(tokenizer: "PreTrainedTokenizerBase", text: str, seq_len: int, windows: int) -> torch.Tensor:
    """The first `windows` consecutive windows of `seq_len` tokens of `text`: `[windows, seq_len]`."""
    if seq_len < 2 or windows < 1:
        raise QuantlabError(f"perplexity needs seq_len >= 2 and windows >= 1, got seq_len={seq_len}, windows={windows}")
    ids = token_ids(tokenizer, text)
    needed = seq_len * windows
    if len(ids) < needed:
        fits = len(ids) // seq_len
        fix = f"pass windows={fits} or less" if fits else f"pass seq_len={len(ids)} or less"
        raise QuantlabError(
            f"the text has {len(ids)} tokens, fewer than the {windows} windows of {seq_len} tokens asked "
            f"({needed} tokens); {fix}, or give a longer text"
        )
    return torch.tensor(ids[:needed], dtype=torch.long).view(windows, seq_len)


def token_ids(tokenizer: "PreTrainedTokenizerBase", text: str) -> list[int]:
    """The ids of the whole text, as the tokenizer encodes it by default."""
    # verbose=False: the "longer than the maximum sequence length" warning is moot, windows are cut after.
    return list(tokenizer(text, return_attention_mask=False, verbose=False)["input_ids"])


def window_losses(model: nn.Module, batches: torch.Tensor, progress: bool = False) -> list[float]:
    """Mean next-token loss of each row of `batches` (`[windows, seq_len]`), one forward per window."""
    with _evaluating(model, batches, progress) as windows:
        return [float(model(x, labels=x).loss) for x in windows]


def chunked_window_losses(
    model: nn.Module,
    batches: torch.Tensor,
    chunk: int,
    new_cache: Callable[[], Any],
    progress: bool = False,
) -> tuple[list[float], Any]:
    """`window_losses`, each window prefilled `chunk` tokens at a time into a fresh `new_cache()`.

    Later chunks attend to what the cache holds of the earlier ones (with a quantized KV cache,
    its quantized states), and the loss of every predicted token of the window is kept, so with a
    float cache the losses equal `window_losses`' up to float rounding. Returns the losses and the
    last window's cache (to read its size).
    """
    if chunk < 1:
        raise QuantlabError(f"the prefill chunk must be at least 1 token, got {chunk}")
    losses, cache = [], None
    with _evaluating(model, batches, progress) as windows:
        for x in windows:
            cache, total = new_cache(), 0.0
            for start in range(0, x.shape[1], chunk):
                logits = model(x[:, start : start + chunk], past_key_values=cache, use_cache=True).logits
                targets = x[:, start + 1 : start + chunk + 1]
                predicted = logits[:, : targets.shape[1]].float()
                total += float(functional.cross_entropy(predicted.flatten(0, 1), targets.flatten(), reduction="sum"))
            losses.append(total / (x.shape[1] - 1))
    return losses, cache


@contextlib.contextmanager
def _evaluating(model: nn.Module, batches: torch.Tensor, progress: bool) -> Iterator[Iterator[torch.Tensor]]:
    """The rows of `batches` as `[1, seq_len]` inputs on the model's device, the model in eval mode and
    inference mode meanwhile (its training mode restored after)."""
    _warn_unless_float32(model)
    device = _device_of(model)
    rows = batches
    if progress:
        from tqdm.auto import tqdm

        rows = tqdm(batches, desc="perplexity", unit="window")
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield (row.unsqueeze(0).to(device) for row in rows)
    finally:
        model.train(was_training)


def checkpoint_perplexity(
    directory: str | os.PathLike,
    text: str,
    tokenizer_dir: str | os.PathLike | None = None,
    seq_len: int = 512,
    windows: int = 16,
    progress: bool = False,
) -> float:
    """Load a saved causal LM (quantized or not) in fp32 and measure `perplexity` on `text`.

    `tokenizer_dir`: where the tokenizer lives when it was not saved beside the model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    tokenizer_source = Path(tokenizer_dir) if tokenizer_dir is not None else directory
    if not (tokenizer_source / "tokenizer_config.json").is_file():
        raise QuantlabError(
            f"no tokenizer in {tokenizer_source}; pass tokenizer_dir= the folder of the base model's tokenizer"
        )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    return perplexity(model, tokenizer, text, seq_len=seq_len, windows=windows, progress=progress)


def _device_of(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def _warn_unless_float32(model: nn.Module) -> None:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes - {torch.float32}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        warnings.warn(
            f"the model computes in {names}: the shared harness (and its baselines) uses float32 compute",
            stacklevel=3,
        )
