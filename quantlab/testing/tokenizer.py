"""A byte-level tokenizer that fits the tiny test models: one token per byte, ids 0..255.

Built in memory from the byte-level alphabet of `tokenizers`, so tests that need a tokenizer
(perplexity, training data, checkpoints the CLI reads) download nothing.
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def byte_tokenizer(*, eos_and_pad: bool = True, model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (ids 0..255, the tiny models' vocabulary size), no merges.

    `eos_and_pad`: id 0 doubles as the end-of-sequence and the padding token, which batching needs.
    `model_max_length`: the length transformers warns beyond (default: its own, effectively none).
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    limits = {} if model_max_length is None else {"model_max_length": model_max_length}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **limits)
    if eos_and_pad:
        tokenizer.eos_token = tokenizer.pad_token = alphabet[0]
    return tokenizer
