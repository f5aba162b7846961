"""Causal-LM data for `quantlab.training.Trainer`: text or JSONL in, held-out windows and training examples out.

Evaluation windows come first and are never trained on: the first `eval_windows x
eval_seq_len` tokens of the text are cut into the windows the perplexity harness
(`quantlab.eval.perplexity`) scores, and training uses only the text after them. With the
bundled WikiText-2 slice those windows are exactly the harness's, so the loop's held-out
perplexity is comparable with every perplexity in benchmarks/RESULTS.md.

Batches are padded to their longest example (dynamic padding); padded positions get label
-100 and attention mask 0. Order, sharding across processes and the data position of a resumed
run are transformers' Trainer's (a seeded sampler, `skip_first_batches`).
"""

import dataclasses
import hashlib
from typing import Any

import torch
from torch.utils.data import Dataset

from quantlab.assets.text import bundled_text
from quantlab.errors import QuantlabError

IGNORE_INDEX = -100


class TokenSequences(Dataset):
    """Training examples: 1-D token-id tensors of any length from 2 up."""

    def __init__(self, sequences: list[torch.Tensor]) -> None:
        if not sequences:
            raise QuantlabError("no training examples: the text after the held-out windows is empty")
        self.sequences = [torch.as_tensor(s, dtype=torch.long) for s in sequences]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.sequences[index]}

    def fingerprint(self) -> str:
        """A hash of every example, so a resumed run can check that it reads the same data."""
        digest = hashlib.sha256()
        for sequence in self.sequences:
            digest.update(len(sequence).to_bytes(8, "little"))
            digest.update(sequence.numpy().tobytes())
        return digest.hexdigest()[:16]


@dataclasses.dataclass
class CausalLMData:
    """Training examples plus the held-out evaluation windows `[windows, eval_seq_len]`."""

    train: TokenSequences
    eval_windows: torch.Tensor | None


@dataclasses.dataclass
class CausalLMCollator:
    """Pads a list of examples to the longest one; labels are the inputs, -100 where padded."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        sequences = [torch.as_tensor(example["input_ids"], dtype=torch.long) for example in examples]
        length = max(len(s) for s in sequences)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            input_ids[row, : len(sequence)] = sequence
            attention_mask[row, : len(sequence)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, pad_to_multiple_of: int | None = None) -> "CausalLMCollator":
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return cls(pad_token_id=pad if pad is not None else 0, pad_to_multiple_of=pad_to_multiple_of)


def causal_lm_data(
    tokenizer: Any,
    documents: list[str] | None = None,
    seq_len: int = 256,
    eval_windows: int = 16,
    eval_seq_len: int = 512,
) -> CausalLMData:
    """Held-out windows from the start of the token stream, training examples from the rest.

    `documents` None: the WikiText-2 slice shipped with quantlab, whose windows are the harness's.

    One document (a text file) is tokenized whole, as the perplexity harness does, and cut
    into examples of `seq_len`. Several documents (JSONL) are tokenized one by one, each
    ending in EOS; the first ones fill the evaluation windows and are left out of training,
    every later one gives examples of at most `seq_len` tokens.
    """
    if seq_len < 2:
        raise QuantlabError(f"seq_len={seq_len} must be at least 2")
    if documents is None:
        documents = [bundled_text()]
    held_out = eval_windows * eval_seq_len
    if len(documents) == 1:
        ids = _token_ids(tokenizer, documents[0])
        _check_length(len(ids), held_out + 2, eval_windows, eval_seq_len)
        windows = torch.tensor(ids[:held_out]).view(eval_windows, eval_seq_len) if eval_windows else None
        return CausalLMData(TokenSequences(_chunks(ids[held_out:], seq_len)), windows)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    examples: list[list[int]] = []
    for document in documents:
        ids = _token_ids(tokenizer, document) + eos
        if len(stream) < held_out:
            stream.extend(ids)
        else:
            examples.extend(_chunks(ids, seq_len))
    _check_length(len(stream), held_out, eval_windows, eval_seq_len)
    windows = torch.tensor(stream[:held_out]).view(eval_windows, eval_seq_len) if eval_windows else None
    return CausalLMData(TokenSequences(examples), windows)


def bundled_data(tokenizer: Any, seq_len: int = 256, eval_windows: int = 16, eval_seq_len: int = 512) -> CausalLMData:
    """The WikiText-2 slice shipped with quantlab: the harness's windows held out, the rest to train on."""
    return causal_lm_data(tokenizer, None, seq_len, eval_windows, eval_seq_len)


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, return_attention_mask=False, verbose=False)["input_ids"])


def _chunks(ids: list[int], seq_len: int) -> list[list[int]]:
    """Consecutive pieces of `seq_len` tokens; a last shorter piece is kept if it has 2 tokens or more."""
    return [ids[start : start + seq_len] for start in range(0, len(ids), seq_len) if len(ids) - start >= 2]


def _check_length(available: int, needed: int, eval_windows: int, eval_seq_len: int) -> None:
    if available < needed:
        raise QuantlabError(
            f"the text has {available} tokens but {eval_windows} held-out windows of {eval_seq_len} tokens "
            f"need {eval_windows * eval_seq_len} plus text to train on; use a longer text or fewer eval_windows"
        )
