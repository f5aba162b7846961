"""Teacher and student must score the same tokens: same vocabulary size, same token ids."""

from typing import Any

from torch import nn

from quantlab.errors import QuantlabError


class VocabularyMismatchError(QuantlabError, ValueError):
    """Teacher and student do not share a vocabulary, so their distributions cannot be compared."""


def vocabulary_size(model: nn.Module) -> int:
    """Width of the model's logits: its output head's `out_features`, or `config.vocab_size`."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    size = getattr(head, "out_features", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(size, int):
        raise QuantlabError(f"cannot tell the vocabulary size of {type(model).__name__} (no output head, no config)")
    return size


def check_vocabularies(
    teacher: nn.Module, student: nn.Module, teacher_tokenizer: Any = None, student_tokenizer: Any = None
) -> None:
    """Raise `VocabularyMismatchError` unless teacher and student share logits width (and tokenizers, if given)."""
    teacher_size, student_size = vocabulary_size(teacher), vocabulary_size(student)
    if teacher_size != student_size:
        raise VocabularyMismatchError(
            f"teacher and student vocabularies differ: the teacher predicts {teacher_size} tokens, the student "
            f"{student_size}; distillation compares their distributions token by token, so pick a student with "
            f"the teacher's tokenizer (same model family)"
        )
    if teacher_tokenizer is None or student_tokenizer is None:
        return
    teacher_vocab, student_vocab = teacher_tokenizer.get_vocab(), student_tokenizer.get_vocab()
    if teacher_vocab != student_vocab:
        differing = sorted(token for token in teacher_vocab if student_vocab.get(token) != teacher_vocab[token])
        example = differing[0] if differing else next(iter(set(student_vocab) - set(teacher_vocab)), "?")
        raise VocabularyMismatchError(
            f"teacher and student tokenizers differ ({len(differing)} token ids disagree, e.g. {example!r}: teacher "
            f"{teacher_vocab.get(example)}, student {student_vocab.get(example)}); distillation needs one tokenizer"
        )
