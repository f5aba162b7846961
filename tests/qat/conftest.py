"""Tiny float teachers and their quantized students (checkpoints with the byte tokenizer) for the QAT tests."""

import pytest

import quantlab
from quantlab.testing import tiny_llama, tiny_llama_checkpoint


@pytest.fixture
def make_checkpoint():
    """`make_checkpoint(path, seed=0, model=None)`: a tiny Llama (or `model`) saved with the byte tokenizer."""
    return tiny_llama_checkpoint


@pytest.fixture
def teacher_and_student(tmp_path):
    """A float tiny Llama's folder and its 3-bit symmetric g32 round-to-nearest checkpoint (no report beside it)."""
    teacher = tiny_llama_checkpoint(tmp_path / "teacher", 0)
    quantized = quantlab.quantize(tiny_llama(0), quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True))
    student = tiny_llama_checkpoint(tmp_path / "student", model=quantized)
    return teacher, student
