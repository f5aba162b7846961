"""Training examples for an encoder: one example a line of text, as the encoder embeds it.

An encoder (a sentence-embedding model such as all-MiniLM-L6-v2) reads one sentence or paragraph
at a time, framed by its tokenizer's special tokens; it is trained on such lines, each cut to
`max_length` tokens. On the bundled text the first `ENCODER_EVAL_LINES` (256) lines are what
encoders are evaluated on (`quantlab.eval.embeddings`), so training starts after them; a text of
the user's own is read whole. The collator is the causal LM's (`CausalLMCollator`): it pads and masks the same way.
"""

from typing import Any

from quantlab.assets.text import bundled_text, text_lines
from quantlab.calibration.data import ENCODER_EVAL_LINES
from quantlab.errors import QuantlabError
from quantlab.training.data import TokenSequences


def encoder_examples(tokenizer: Any, documents: list[str] | None = None, max_length: int = 256) -> TokenSequences:
    """Each non-empty line of `documents` tokenized with the tokenizer's special tokens, cut to `max_length`.

    `documents` None: the lines of the bundled WikiText-2 slice after its first `ENCODER_EVAL_LINES`.
    """
    if max_length < 2:
        raise QuantlabError(f"max_length={max_length} must be at least 2 tokens")
    if documents is None:
        lines = text_lines(bundled_text())[ENCODER_EVAL_LINES:]
    else:
        lines = [line for document in documents for line in text_lines(document)]
    if not lines:
        raise QuantlabError("no training examples: the text has no non-empty line; pass a text with some")
    encoded = tokenizer(lines, truncation=True, max_length=max_length, return_attention_mask=False, verbose=False)
    return TokenSequences([ids for ids in encoded["input_ids"] if len(ids) >= 2])
