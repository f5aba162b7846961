"""Fixtures for the training tests: tiny Llamas (float or quantized, with LoRA), token data, quick `TrainingArguments`.

The builders are handed out as fixtures (`make_qlora`, `make_data`, `make_config`) because the
suite imports test modules with `--import-mode=importlib`, where test modules cannot import helpers.
"""

import pytest
import torch
from peft import prepare_model_for_kbit_training
from transformers import PreTrainedTokenizerFast

from quantlab.convert import quantize
from quantlab.registry import get_method, list_methods
from quantlab.testing import byte_tokenizer, tiny_llama
from quantlab.training import TokenSequences, add_lora, training_arguments


def default_configs() -> list:
    """Every registered method (plugins included) with its default options."""
    return [get_method(name).config_class() for name in list_methods()]


def qlora_model(
    config=None,
    seed: int = 0,
    r: int = 4,
    dropout: float = 0.0,
    checkpointing: bool = False,
    lora_seed: int = 1,
    alpha: float | None = None,
):
    """A tiny Llama, quantized with `config` (float if None), with LoRA on every projection."""
    torch.manual_seed(seed)
    model = tiny_llama(seed)
    if config is not None:
        quantize(model, config)
        options = {"use_reentrant": False}  # PEFT's recipe; quantlab's layers are k-bit layers to it
        prepare_model_for_kbit_training(model, checkpointing, gradient_checkpointing_kwargs=options)
    else:
        model.requires_grad_(False)
    torch.manual_seed(lora_seed)
    return add_lora(model, r=r, alpha=2 * r if alpha is None else alpha, dropout=dropout, init_lora_weights=False)


def token_data(count: int = 48, low: int = 6, high: int = 33, seed: int = 0) -> TokenSequences:
    """Examples of varied length drawn from a small repeating pattern, so a model can learn them."""
    generator = torch.Generator().manual_seed(seed)
    pattern = torch.arange(40) % 13 + 10
    sequences = []
    for _ in range(count):
        length = int(torch.randint(low, high, (), generator=generator))
        start = int(torch.randint(0, 7, (), generator=generator))
        sequences.append(pattern[start : start + length])
    return TokenSequences(sequences)


def quick_config(output_dir, **overrides):
    """`TrainingArguments` of a short run (names are TrainingArguments fields)."""
    options = {
        "output_dir": str(output_dir),
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "disable_tqdm": True,
    }
    return training_arguments({**options, **overrides})


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (ids 0..255, the tiny models' vocabulary); id 0 doubles as EOS and padding."""
    return byte_tokenizer()


@pytest.fixture
def make_qlora():
    return qlora_model


@pytest.fixture
def make_data():
    return token_data


@pytest.fixture
def make_config():
    return quick_config
