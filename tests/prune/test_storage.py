"""Sparse checkpoints: compact on disk, identical after reload, masks restored, quantized codes too."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.prune import (
    is_sparse_checkpoint,
    load_sparse,
    make_permanent,
    mask_of,
    masked_layers,
    prune,
    save_sparse,
    sparse_storage,
)
from quantlab.prune.storage import SPARSE_WEIGHTS_FILE
from quantlab.testing import tiny_llama


def _assert_same_state(a, b) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name


@pytest.mark.parametrize(("pattern", "sparsity"), [("unstructured", 0.5), ("2:4", None), ("4:8", None)])
def test_half_sparse_linear_weights_take_at_most_0_6_of_their_dense_size(tmp_path, pattern, sparsity):
    model = tiny_llama()
    prune(model, pattern, sparsity)
    save_sparse(model, tmp_path / "sparse")
    storage = sparse_storage(tmp_path / "sparse")
    assert storage.ratio() <= 0.6
    assert storage.ratio() == pytest.approx(17 / 32, abs=0.01)  # fp32 values + 1-bit mask
    assert storage.file_bytes < storage.dense_bytes


def test_size_on_disk_falls_with_sparsity(tmp_path):
    sizes = []
    for sparsity in (0.3, 0.6, 0.9):
        model = tiny_llama()
        prune(model, "unstructured", sparsity)
        save_sparse(model, tmp_path / str(sparsity))
        sizes.append(sparse_storage(tmp_path / str(sparsity)).file_bytes)
    assert sizes[0] > sizes[1] > sizes[2]


def test_reload_gives_the_same_weights_and_the_masks_back(tmp_path):
    model = tiny_llama(tie_word_embeddings=True)
    prune(model, "unstructured", 0.7)
    save_sparse(model, tmp_path / "sparse")
    reloaded = load_sparse(tmp_path / "sparse")
    _assert_same_state(model, reloaded)
    assert masked_layers(reloaded).keys() == masked_layers(model).keys()
    for name, layer in masked_layers(model).items():
        assert torch.equal(mask_of(masked_layers(reloaded)[name]), mask_of(layer))
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()  # still tied


def test_bfloat16_model_round_trips(tmp_path):
    model = tiny_llama().to(torch.bfloat16)
    prune(model, "2:4")
    save_sparse(model, tmp_path / "sparse")
    assert sparse_storage(tmp_path / "sparse").ratio() == pytest.approx(9 / 16, abs=0.01)
    reloaded = load_sparse(tmp_path / "sparse", dtype=torch.bfloat16)
    _assert_same_state(model, reloaded)


@pytest.mark.parametrize(
    "config",
    [
        quantlab.Int8SymmetricConfig(),
        quantlab.NF4Config(blocksize=32),
        quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True),
    ],
    ids=["int8", "nf4", "custom_bits-sym"],
)
def test_pruned_then_quantized_checkpoint_is_sparse_and_bit_identical(tmp_path, config):
    model = tiny_llama()
    prune(model, "unstructured", 0.5)
    make_permanent(model)
    quantlab.quantize(model, config)
    save_sparse(model, tmp_path / "sparse")
    storage = sparse_storage(tmp_path / "sparse")
    assert {t.kind for t in storage.tensors.values()} == {"quantized"}
    assert storage.ratio() < 0.85  # codes of live weights + 1-bit mask + one fill code per group
    reloaded = load_sparse(tmp_path / "sparse")
    _assert_same_state(model, reloaded)
    weight = reloaded.model.layers[0].mlp.up_proj.dequantize_weight()
    assert float((weight == 0).float().mean()) >= 0.5  # pruned weights are still exactly zero


def test_asymmetric_codes_that_cannot_hold_zero_are_stored_dense_and_still_reload(tmp_path):
    model = tiny_llama()
    prune(model, "unstructured", 0.5)
    quantlab.quantize(model, quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=False))
    save_sparse(model, tmp_path / "sparse")
    _assert_same_state(model, load_sparse(tmp_path / "sparse"))


def test_plain_from_pretrained_fails_loudly_instead_of_loading_missing_weights(tmp_path):
    model = tiny_llama()
    prune(model, "unstructured", 0.5)
    save_sparse(model, tmp_path / "sparse")
    assert is_sparse_checkpoint(tmp_path / "sparse")
    with pytest.raises(OSError, match=r"model\.safetensors"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "sparse")


def test_file_describes_its_encoding(tmp_path):
    model = tiny_llama()
    prune(model, "2:4")
    save_sparse(model, tmp_path / "sparse")
    with safe_open(tmp_path / "sparse" / SPARSE_WEIGHTS_FILE, framework="pt") as handle:
        described = json.loads(handle.metadata()["quantlab_sparse"])
    entry = described["tensors"]["model.layers.0.mlp.up_proj.weight"]
    assert entry["encoding"] == "bitmask" and entry["shape"] == [192, 64] and entry["live"] == 192 * 32


def test_dense_checkpoint_loads_through_load_sparse_too(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "dense")
    _assert_same_state(model, load_sparse(tmp_path / "dense"))


def test_existing_output_is_not_overwritten_unless_asked(tmp_path):
    model = tiny_llama()
    prune(model, "2:4")
    save_sparse(model, tmp_path / "sparse")
    with pytest.raises(quantlab.QuantlabError, match="already exists"):
        save_sparse(model, tmp_path / "sparse")
    save_sparse(model, tmp_path / "sparse", overwrite=True)


def test_sparse_checkpoint_quantizes_while_loading_and_saves_sparse_again(tmp_path):
    model = tiny_llama()
    prune(model, "unstructured", 0.5)
    save_sparse(model, tmp_path / "sparse")
    quantized = load_sparse(tmp_path / "sparse", quantization_config=quantlab.NF4Config(blocksize=32))
    layer = quantized.model.layers[0].mlp.up_proj
    assert isinstance(layer, quantlab.QuantizedLinear)
    assert float((layer.dequantize_weight() == 0).float().mean()) == pytest.approx(0.5)
    save_sparse(quantized, tmp_path / "sparse-nf4")
    assert sparse_storage(tmp_path / "sparse-nf4").ratio() < 0.85
    _assert_same_state(quantized, load_sparse(tmp_path / "sparse-nf4"))
