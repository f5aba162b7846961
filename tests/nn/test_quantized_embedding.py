"""Quantized embedding tables and output heads (`embedding_bits`): tied and untied, on every path."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.errors import CheckpointError, ConfigError, QuantizationError
from quantlab.formats import packing
from quantlab.kernels.reference import dequantize_matmul
from quantlab.nn.quantized_embedding import (
    QuantizedEmbedding,
    QuantizedOutputHead,
    TiedOutputHead,
    unpack_arithmetic,
)
from quantlab.replacement import quantized_layers
from quantlab.testing import tiny_bert, tiny_llama

IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _tensor_names(directory) -> list[str]:
    with safe_open(directory / "model.safetensors", "pt") as handle:
        return sorted(handle.keys())


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_table_is_each_row_rounded_on_its_grid(bits):
    """Every stored row decodes within half a step of the float row: the layout's round-to-nearest bound."""
    model = tiny_llama()
    table = model.model.embed_tokens.weight.detach().clone()
    quantlab.quantize(model, quantlab.CustomBitsConfig(embedding_bits=bits, embedding_group_size=32))
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)
    assert embedding.layout.codec == ("int8" if bits == 8 else "affine") and embedding.layout.group_size == 32
    decoded = embedding.dequantize_weight()
    step = embedding.weight_scale.float().repeat_interleave(32, dim=1)[:, : table.shape[1]]
    assert ((decoded - table).abs() <= step / 2 + 1e-6).all()
    # A lookup decodes the gathered rows exactly as the whole table decodes.
    assert torch.equal(embedding(IDS), decoded[IDS])


def test_tied_head_reads_the_embedding_codes_and_the_file_holds_them_once(tmp_path):
    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=quantlab.NF4Config(embedding_bits=8)
    )
    assert isinstance(model.lm_head, TiedOutputHead) and model.lm_head.embedding is model.model.embed_tokens
    assert dict(model.lm_head.named_buffers()) == {} and dict(model.lm_head.named_parameters()) == {}
    hidden = torch.randn(3, 64)
    reference = hidden @ model.model.embed_tokens.dequantize_weight().T
    torch.testing.assert_close(model.lm_head(hidden), reference, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "quantized")
    vocabulary = [n for n in _tensor_names(tmp_path / "quantized") if "embed" in n or "lm_head" in n]
    assert vocabulary == ["model.embed_tokens.weight", "model.embed_tokens.weight_scale"]
    # The table in 8 bits: 256 x 64 codes plus one float16 scale per 64.
    assert model.model.embed_tokens.stored_bytes() == 256 * 64 + 256 * 2


def test_untied_head_stores_its_own_table_outside_the_linear_layers(tmp_path):
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=False), quantlab.NF4Config(embedding_bits=8))
    assert isinstance(model.lm_head, QuantizedOutputHead)
    assert "lm_head" not in quantized_layers(model)  # bits per weight of the Linear layers leave it out
    model.save_pretrained(tmp_path)
    names = _tensor_names(tmp_path)
    assert {"lm_head.weight", "lm_head.weight_scale", "model.embed_tokens.weight"} <= set(names)


EMBEDDING_CONFIG = quantlab.CustomBitsConfig(bits=4, group_size=64, symmetric=True, embedding_bits=6)

# Reloads each saved checkpoint (argv: JSON {name: folder}) in a process that never imports quantlab.
RELOAD_CHILD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
folders, ids, output = json.loads(sys.argv[1]), torch.load(sys.argv[2]), sys.argv[3]
results = {}
for name, folder in folders.items():
    model = AutoModelForCausalLM.from_pretrained(folder)
    embedding = type(model.model.embed_tokens).__name__
    with torch.no_grad():
        results[name] = (embedding, type(model.lm_head).__name__, model(ids).logits)
torch.save(results, output)
"""


@pytest.fixture(scope="module")
def saved_with_tables(tmp_path_factory) -> dict[str, tuple[nn.Module, nn.Module, dict]]:
    """Tied and untied tiny Llamas with 6-bit tables, quantized on load and saved, then reloaded together
    in one fresh process: name -> (quantized on load, quantized by `quantize`, the fresh process's results)."""
    root = tmp_path_factory.mktemp("tables")
    models, folders = {}, {}
    for name, tied in (("tied", True), ("untied", False)):
        tiny_llama(tie_word_embeddings=tied).save_pretrained(root / f"{name}-float")
        loaded = AutoModelForCausalLM.from_pretrained(root / f"{name}-float", quantization_config=EMBEDDING_CONFIG)
        loaded.save_pretrained(root / name)
        models[name] = (loaded, quantlab.quantize(tiny_llama(tie_word_embeddings=tied), EMBEDDING_CONFIG))
        folders[name] = str(root / name)
    torch.save(IDS, root / "ids.pt")
    command = [sys.executable, "-c", RELOAD_CHILD, json.dumps(folders), str(root / "ids.pt"), str(root / "out.pt")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    reloaded = torch.load(root / "out.pt")
    return {name: (*models[name], reloaded[name]) for name in models}


@pytest.mark.subprocess
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_quantize_and_quantize_on_load_agree_and_reload_bit_identically_in_a_fresh_process(tied, saved_with_tables):
    loaded, converted, (embedding, head, logits) = saved_with_tables["tied" if tied else "untied"]
    expected = _logits(loaded)
    assert torch.equal(_logits(converted), expected)
    assert embedding == "QuantizedEmbedding"
    assert head == ("TiedOutputHead" if tied else "QuantizedOutputHead")
    assert torch.equal(logits, expected)


def test_calibrated_solver_calibrates_on_the_float_embedding_then_rounds_it():
    config = quantlab.CustomBitsConfig(bits=4, symmetric=True, solver="gptq", embedding_bits=8)
    windows = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=True), config, calibration=windows, progress=False)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, TiedOutputHead)
    assert len(quantized_layers(model)) == 14
    # The table is round-to-nearest, exactly as without calibration.
    plain = quantlab.quantize(tiny_llama(tie_word_embeddings=True), quantlab.CustomBitsConfig(embedding_bits=8))
    assert torch.equal(model.model.embed_tokens.weight, plain.model.embed_tokens.weight)


def test_tie_weights_again_and_dequantize_give_the_float_tied_model_back():
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=True), quantlab.Int8SymmetricConfig(embedding_bits=8))
    expected = _logits(model)
    model.tie_weights()  # recomputes transformers' tying map: must leave the quantized head as it is
    assert torch.equal(_logits(model), expected)
    quantlab.dequantize(model)
    assert type(model.model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(_logits(model), expected, rtol=1e-5, atol=1e-5)


def test_native_head_kernel_matches_the_reference():
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=True), quantlab.NF4Config(embedding_bits=5))
    hidden = torch.randn(4, 64)
    expected = dequantize_matmul(model.model.embed_tokens, hidden)
    torch.testing.assert_close(model.lm_head(hidden), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", range(1, 9))
def test_arithmetic_unpacking_equals_bit_unpacking(bits):
    codes = torch.randint(0, 1 << bits, (3, 2, 61), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    assert torch.equal(unpack_arithmetic(packing.pack(codes, bits), bits, 61), codes)


def _saved(tmp_path, tied: bool):
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=tied), quantlab.NF4Config(embedding_bits=8))
    model.save_pretrained(tmp_path)
    return tmp_path


def _edit(directory, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _nan_scale(tensors):
    tensors["model.embed_tokens.weight_scale"] = tensors["model.embed_tokens.weight_scale"].clone()
    tensors["model.embed_tokens.weight_scale"][3, 0] = float("nan")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_nan_scale, r"model\.embed_tokens\.weight_scale holds 1 NaN/Inf"),
        (lambda t: t.pop("model.embed_tokens.weight_scale"), r"model\.embed_tokens\.weight_scale is missing"),
        (
            lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"][:, :, :32].clone()}),
            r"model\.embed_tokens\.weight in model\.safetensors is int8 \[256, 1, 32\] but its layout needs "
            r"int8 \[256, 1, 64\]",
        ),
    ],
    ids=["nan-scale", "scale-deleted", "codes-cut"],
)
def test_damaged_embedding_table_is_refused(edit, message, tmp_path):
    directory = _saved(tmp_path, tied=True)
    AutoModelForCausalLM.from_pretrained(directory)  # intact: loads
    _edit(directory, edit)
    with pytest.raises(CheckpointError, match=message):
        AutoModelForCausalLM.from_pretrained(directory)


def test_damaged_untied_head_is_refused(tmp_path):
    directory = _saved(tmp_path, tied=False)
    _edit(directory, lambda t: t.pop("lm_head.weight_scale"))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight_scale is missing"):
        AutoModelForCausalLM.from_pretrained(directory)


def test_lora_trains_the_projections_while_the_quantized_embedding_stays_frozen():
    from peft import prepare_model_for_kbit_training

    from quantlab.training import add_lora

    model = quantlab.quantize(tiny_llama(tie_word_embeddings=True), quantlab.NF4Config(embedding_bits=8))
    prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    model = add_lora(model, r=4, alpha=8, init_lora_weights=False)
    codes_before = model.base_model.model.model.embed_tokens.weight.clone()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    losses = []
    for _ in range(3):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert torch.equal(model.base_model.model.model.embed_tokens.weight, codes_before)


@pytest.mark.parametrize(
    ("tied", "bits", "codes"), [(True, 8, "INT8"), (False, 5, "UINT8")], ids=["tied-int8", "untied-5bit"]
)
def test_onnx_export_gathers_the_stored_codes(tied, bits, codes, tmp_path):
    import onnx_ir as ir

    from quantlab.export import to_onnx
    from quantlab.export.onnx.runtime import OnnxCausalLM

    config = quantlab.NF4Config(embedding_bits=bits)
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=tied), config)
    to_onnx(model, tmp_path / "model.onnx")
    initializers = ir.load(tmp_path / "model.onnx").graph.initializers
    tables = {name: value.const_value.dtype for name, value in initializers.items() if "embed" in name}
    assert tables == {
        "model.model.embed_tokens.weight": getattr(ir.DataType, codes),
        "model.model.embed_tokens.weight_scale": ir.DataType.FLOAT16,
    }
    head = {name: value.const_value.dtype for name, value in initializers.items() if name.endswith("lm_head.weight")}
    assert head == ({} if tied else {"model.lm_head.weight": getattr(ir.DataType, codes)})
    # No float copy of a table anywhere in the file.
    assert not any(
        v.const_value.dtype.is_floating_point() and v.const_value.size >= 256 * 64 for v in initializers.values()
    )
    mask = torch.ones_like(IDS)
    with torch.no_grad():
        expected = model(input_ids=IDS, attention_mask=mask).logits
    assert (OnnxCausalLM(tmp_path / "model.onnx")(IDS, mask) - expected).abs().max() <= 1e-4


def test_encoder_embeddings_are_quantized_too():
    model = quantlab.quantize(tiny_bert(), quantlab.Int8SymmetricConfig(embedding_bits=8))
    assert isinstance(model.embeddings.word_embeddings, QuantizedEmbedding)
    assert type(model.embeddings.position_embeddings) is nn.Embedding  # only the vocabulary table


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"embedding_bits": 3}, r"embedding_bits=3 is not valid; use a whole number from 4 to 8"),
        ({"embedding_bits": 9}, r"embedding_bits=9 is not valid"),
        ({"embedding_bits": True}, r"embedding_bits=True is not valid"),
        ({"embedding_bits": "8"}, r"embedding_bits='8' is not valid"),
        ({"embedding_bits": 8, "embedding_group_size": 48}, r"embedding_group_size=48 is not valid"),
    ],
)
def test_bad_embedding_options_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        quantlab.NF4Config(**options)


def test_a_model_without_input_embeddings_is_refused():
    with pytest.raises(QuantizationError, match="has none"):
        quantlab.quantize(nn.Sequential(nn.Linear(64, 64)), quantlab.Int8SymmetricConfig(embedding_bits=8))


def test_default_keeps_the_tables_in_float():
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=True), quantlab.NF4Config())
    assert type(model.model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_checkpoint_bits_count_the_linear_layers_and_the_file_the_tables(tied, tmp_path):
    from quantlab.eval.size import checkpoint_storage

    storages = {}
    for bits in (None, 8):
        model = quantlab.quantize(tiny_llama(tie_word_embeddings=tied), quantlab.NF4Config(embedding_bits=bits))
        model.save_pretrained(tmp_path / str(bits))
        storages[bits] = checkpoint_storage(tmp_path / str(bits))  # shapes from config.json, on meta
    plain, embedded = storages[None], storages[8]
    assert embedded.layers.keys() == plain.layers.keys() and "lm_head" not in embedded.layers
    assert embedded.bits_per_weight == plain.bits_per_weight
    tables = 1 if tied else 2
    assert plain.other_bytes - embedded.other_bytes == tables * (256 * 64 * 4 - (256 * 64 + 256 * 2))


def test_merging_lora_keeps_or_dequantizes_the_table_with_the_rest():
    from quantlab.training import add_lora, merge_to_float, merge_to_quantized

    def adapted():
        model = quantlab.quantize(tiny_llama(tie_word_embeddings=True), quantlab.NF4Config(embedding_bits=8))
        torch.manual_seed(1)  # the same random adapter each time
        return add_lora(model, r=4, alpha=8, dropout=0.0, init_lora_weights=False)

    expected = _logits(adapted())
    merged = merge_to_quantized(adapted())
    assert isinstance(merged.model.embed_tokens, QuantizedEmbedding) and isinstance(merged.lm_head, TiedOutputHead)
    as_float = merge_to_float(adapted())
    assert (
        type(as_float.model.embed_tokens) is nn.Embedding
        and as_float.lm_head.weight is as_float.model.embed_tokens.weight
    )
    assert not hasattr(as_float.config, "quantization_config")
    torch.testing.assert_close(_logits(as_float), expected, rtol=1e-4, atol=1e-4)


def test_calibrated_quantize_on_load_quantizes_the_table_after_the_blocks(tmp_path):
    from quantlab.testing import tiny_llama_checkpoint

    directory = tiny_llama_checkpoint(tmp_path / "float", model=tiny_llama(tie_word_embeddings=True))
    config = quantlab.CustomBitsConfig(
        bits=4, symmetric=True, solver="gptq", calibration_samples=4, calibration_seq_len=32, embedding_bits=8
    )
    model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=config)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, TiedOutputHead)
    assert len(quantized_layers(model)) == 14
    expected = _logits(model)
    model.save_pretrained(tmp_path / "quantized")
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "quantized")), expected)


def test_generate_decodes_through_the_tied_quantized_head():
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=True), quantlab.NF4Config(embedding_bits=8))
    prompt = IDS[:1, :6]
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    tokens = prompt
    for _ in range(6):  # greedy by hand, recomputing the whole sequence each step
        with torch.no_grad():
            tokens = torch.cat([tokens, model(tokens).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, tokens)


def test_compiled_lookup_and_tied_head_run_in_one_graph():
    from quantlab.kernels.cpu import ops

    if not ops.available():
        pytest.skip("the kernels are not built as torch operators here (ctypes calls break graphs)")
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=True), quantlab.NF4Config(embedding_bits=8))
    hidden = torch.randn(3, 64)
    with torch.no_grad():
        head = torch.compile(model.lm_head, fullgraph=True)(hidden)
        rows = torch.compile(model.model.embed_tokens, fullgraph=True)(IDS)
        torch.testing.assert_close(head, model.lm_head(hidden), rtol=1e-5, atol=1e-5)
        assert torch.equal(rows, model.model.embed_tokens(IDS))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_parameter_counts_equal_the_float_models(tied):
    float_model = tiny_llama(tie_word_embeddings=tied)
    expected = {flag: float_model.num_parameters(exclude_embeddings=flag) for flag in (False, True)}
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=tied), quantlab.NF4Config(embedding_bits=8))
    assert {flag: model.num_parameters(exclude_embeddings=flag) for flag in (False, True)} == expected
    assert model.num_parameters(only_trainable=True) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_peft_recipe_counts_and_trains_with_a_quantized_tied_table(tmp_path):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantlab.NF4Config(embedding_bits=8))
    model = get_peft_model(prepare_model_for_kbit_training(model), LoraConfig(r=4, target_modules="all-linear"))
    trainable, total = model.get_nb_trainable_parameters()
    assert total - trainable == tiny_llama(tie_word_embeddings=True).num_parameters()
    model(input_ids=IDS, labels=IDS).loss.backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert len(with_grad) == 28 and all("lora_" in name for name in with_grad)  # 14 projections, A and B
