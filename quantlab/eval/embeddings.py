"""How close an encoder's sentence embeddings stay to its float model's: mean cosine on text lines.

An embedding model has no perplexity; what users keep of it is the sentence embedding. The measure
(the one `benchmarks/quality.py` reports for all-MiniLM-L6-v2) embeds each non-empty line of a
text by mean pooling of the last hidden states over the attention mask, as sentence-transformers
configures such models, and compares each line's embedding with the float model's by cosine.
On the bundled text the evaluation lines are its first `ENCODER_EVAL_LINES` non-empty lines;
training and calibration of encoders read only the text after them.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantlab.assets.text import text_lines
from quantlab.calibration.data import ENCODER_EVAL_LINES
from quantlab.errors import QuantlabError

EMBEDDING_MAX_TOKENS = 256  # tokens a line is cut to (sentence-transformers' max_seq_length for MiniLM-L6)


def evaluation_lines(text: str, lines: int = ENCODER_EVAL_LINES) -> list[str]:
    """The first `lines` non-empty lines of `text` (fewer when it is shorter; none is an error)."""
    found = text_lines(text)[:lines]
    if not found:
        raise QuantlabError("the evaluation text has no non-empty line to embed; pass a text with some")
    return found


def sentence_embeddings(
    model: nn.Module, tokenizer: Any, lines: list[str], max_tokens: int = EMBEDDING_MAX_TOKENS, batch: int = 32
) -> torch.Tensor:
    """`[lines, hidden]` float32 embeddings: the last hidden states mean-pooled over each line's tokens.

    Lines are cut to `max_tokens`, or to the positions the model has when it has fewer."""
    max_tokens = min(max_tokens, position_limit(model))
    chunks = []
    with torch.inference_mode():
        for start in range(0, len(lines), batch):
            encoded = tokenizer(
                lines[start : start + batch], padding=True, truncation=True, max_length=max_tokens, return_tensors="pt"
            )
            encoded = {key: value for key, value in encoded.items() if key in ("input_ids", "attention_mask")}
            hidden = model(**encoded, output_hidden_states=True).hidden_states[-1]
            chunks.append(mean_pooled(hidden, encoded["attention_mask"]))
    return torch.cat(chunks)


def mean_pooled(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`[examples, hidden]` float32: each example's `[tokens, hidden]` states averaged over its real tokens."""
    mask = attention_mask.unsqueeze(-1).float()
    return (hidden.float() * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


def embedding_cosines(embeddings: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The cosine of each line's embedding with the reference model's: `[lines]`."""
    return F.cosine_similarity(embeddings.float(), reference.float(), dim=-1)


def position_limit(model: nn.Module) -> int:
    """The longest input `model` reads (`config.max_position_embeddings`; unbounded when it names none)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else 1 << 30
