"""`quantlab.load` and `quantlab.save_quantized`: the library functions the commands call."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.loading import ModelSourceError
from quantlab.saving import NotQuantizedError
from quantlab.testing import byte_tokenizer, tiny_llama_checkpoint
from quantlab.utils.atomic import OutputExistsError, UnsafeOutputError

PROBE = torch.arange(40).reshape(2, 20) * 7 % 256


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("float") / "tiny")


def test_load_quantizes_while_loading_as_from_pretrained_does(float_dir):
    model = quantlab.load(float_dir, quantization_config=quantlab.NF4Config())
    expected = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=quantlab.NF4Config())
    assert isinstance(model.model.layers[0].self_attn.q_proj, quantlab.QuantizedLinear)
    assert not model.training
    assert torch.equal(_logits(model), _logits(expected))


def test_load_with_tokenizer_returns_the_saved_tokenizer(float_dir):
    loaded = quantlab.load_with_tokenizer(str(float_dir))
    assert loaded.tokenizer is not None and loaded.tokenizer("ab")["input_ids"] == byte_tokenizer()("ab")["input_ids"]
    assert not isinstance(loaded.model.model.layers[0].self_attn.q_proj, quantlab.QuantizedLinear)
    assert loaded.source.path == float_dir


def test_save_quantized_round_trips_bit_identically(float_dir, tmp_path):
    loaded = quantlab.load_with_tokenizer(float_dir, quantization_config=quantlab.Int8SymmetricConfig())
    output = quantlab.save_quantized(loaded.model, tmp_path / "int8", loaded.tokenizer)
    assert (output / "tokenizer_config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int8"]  # no staging folder left behind
    reloaded = quantlab.load(output)
    assert torch.equal(_logits(reloaded), _logits(loaded.model))


def test_loading_a_quantized_folder_with_a_config_is_refused(float_dir, tmp_path):
    quantlab.save_quantized(quantlab.load(float_dir, quantization_config=quantlab.NF4Config()), tmp_path / "nf4")
    with pytest.raises(ModelSourceError, match=r"already quantized \(quantlab_nf4\); load it without"):
        quantlab.load(tmp_path / "nf4", quantization_config=quantlab.NF4Config())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing", "does not exist; pass a Hugging Face model folder or a .gguf file"),
        (lambda tmp: tmp, "is not a Hugging Face model folder: it has no config.json"),
        (lambda tmp: (tmp / "weights.bin").write_bytes(b"x") and tmp / "weights.bin", "neither a model folder"),
    ],
)
def test_bad_sources_are_one_line_value_errors(tmp_path, make, message):
    with pytest.raises(ValueError, match=message) as caught:
        quantlab.load(make(tmp_path))
    assert isinstance(caught.value, quantlab.QuantlabError) and "\n" not in str(caught.value)


def test_save_quantized_refuses_a_float_model(float_dir, tmp_path):
    with pytest.raises(NotQuantizedError, match="no quantized layer; load it with quantization_config="):
        quantlab.save_quantized(quantlab.load(float_dir), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_save_quantized_never_replaces_an_existing_folder_without_overwrite(float_dir, tmp_path):
    model = quantlab.load(float_dir, quantization_config=quantlab.NF4Config())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        quantlab.save_quantized(model, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    quantlab.save_quantized(model, tmp_path / "out", overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "config.json").is_file()


def test_save_quantized_never_destroys_the_folder_the_model_came_from(tmp_path):
    source = tiny_llama_checkpoint(tmp_path / "models" / "tiny")
    model = quantlab.load(source, quantization_config=quantlab.NF4Config())
    with pytest.raises(QuantlabErrorOrUnsafe):
        quantlab.save_quantized(model, source, overwrite=True)
    with pytest.raises(UnsafeOutputError):
        quantlab.save_quantized(model, tmp_path / "models", overwrite=True)  # holds the source
    assert (source / "model.safetensors").is_file()


QuantlabErrorOrUnsafe = (quantlab.QuantlabError, UnsafeOutputError)


def test_a_failing_before_commit_leaves_nothing_written(float_dir, tmp_path):
    model = quantlab.load(float_dir, quantization_config=quantlab.NF4Config())
    seen = []

    def inspect_then_fail(staging: Path) -> None:
        seen.append(sorted(p.name for p in staging.iterdir()))
        raise RuntimeError("evaluation failed")

    with pytest.raises(RuntimeError, match="evaluation failed"):
        quantlab.save_quantized(model, tmp_path / "out", before_commit=inspect_then_fail)
    assert "config.json" in seen[0] and "model.safetensors" in seen[0]  # it saw the complete checkpoint
    assert list(tmp_path.iterdir()) == []
