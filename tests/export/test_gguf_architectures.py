"""`to_gguf` on OLMoE, Granite, Phi-3, Gemma 2, Gemma 3 and OLMo 2: llama.cpp itself (llama-cpp-python) computes
transformers' logits from a float32 file and quantlab's from a 4-bit one, every quantized Linear's codes land in
the file unchanged, Gemma's norms are stored as `1 + weight`, and settings llama.cpp's graphs cannot express are
refused in one line, writing nothing."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM  # noqa: E402

import quantlab  # noqa: E402
from quantlab.export.gguf import GGUFExportError, to_gguf  # noqa: E402
from quantlab.export.gguf.architectures import architecture_of, gguf_name, rope_rows  # noqa: E402
from quantlab.nn import QuantizedLinear  # noqa: E402
from quantlab.testing.architectures import tiny_config  # noqa: E402
from quantlab.testing.tokenizer import byte_tokenizer  # noqa: E402

SYMMETRIC_4 = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, scale_dtype="float16", embedding_bits=8)
# Gemma's embedding table scales its rows (`Gemma2TextScaledWordEmbedding`), which `embedding_bits` does not quantize:
# the table stays float, written in F32.
LINEARS_ONLY = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, scale_dtype="float16")
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 100, 101, 102, 33, 34, 35, 36, 37]
MODEL_TYPES = ["olmoe", "granite", "phi3", "gemma2", "gemma3_text", "olmo2"]

# What each tiny config needs for llama.cpp's graph (anything else is refused, see the last tests), and settings
# that make the graph's own features show within the 16-token prompt.
_FOR_LLAMA_CPP = {
    "olmoe": {"num_key_value_heads": 4},  # llama.cpp's olmoe key norm is as wide as the hidden state
    "granite": {
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.2,
        "logits_scaling": 8.0,
    },
    "gemma2": {"query_pre_attn_scalar": 16, "sliding_window": 4},  # llama.cpp scales queries by 1/sqrt(head_dim)
    "gemma3_text": {"query_pre_attn_scalar": 16, "sliding_window": 4},
}
# Variants that reach further parts of the graphs.
_VARIANTS = {
    "phi3-tied": ("phi3", {"tie_word_embeddings": True}),
    "phi3-partial-rotary": (
        "phi3",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ),
    # a full-attention layer (the sixth), its rotary linearly scaled at base 1e6, the sliding ones at base 1000
    "gemma3_text-global": (
        "gemma3_text",
        {
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        },
    ),
    "gemma3_text-final-softcap": ("gemma3_text", {"final_logit_softcapping": 3.0}),
    # llama.cpp's Gemma 2 27B (its 46 blocks) scales queries by 1/sqrt(hidden / heads), not by 1/sqrt(head_dim)
    "gemma2-27b-scale": (
        "gemma2",
        {"num_hidden_layers": 46, "head_dim": 32, "layer_types": ["sliding_attention", "full_attention"] * 23},
    ),
}


def _config(model_type: str, **overrides):
    config = tiny_config(model_type)
    for name, value in {**_FOR_LLAMA_CPP.get(model_type, {}), **overrides}.items():
        setattr(config, name, value)
    return config


def _spread_model(model_type: str, **overrides):
    """A seeded float model with weights spread wide enough (0.1) for its most likely tokens to be clear."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(model_type, initializer_range=0.1, **overrides)).eval()


def _llama_cpp_logits(path) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (the peers extra)")
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(PROMPT)
    logits = np.asarray(llm.scores[: len(PROMPT)], dtype=np.float32)
    llm.close()
    return logits


def _quantized(model_type: str):
    """The spread model quantized to 4-bit symmetric g32, and the fallback type its float tables need (F32 for
    Gemma's, which stay float; Q8_0 tables from int8 codes otherwise)."""
    gemma = model_type.startswith("gemma")
    model = quantlab.quantize(_spread_model(model_type), LINEARS_ONLY if gemma else SYMMETRIC_4, progress=False)
    return model, "F32" if gemma else None


def _relative_error(model, path) -> tuple[float, np.ndarray, np.ndarray]:
    theirs = _llama_cpp_logits(path)
    with torch.no_grad():
        ours = model(torch.tensor([PROMPT])).logits[0].numpy()
    return float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours)), theirs, ours


def _read(path) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF tensor name → (type name, float32 values in torch's order)."""
    tensors = {}
    for tensor in gguf.GGUFReader(path).tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        tensors[tensor.name] = tensor.tensor_type.name, values.reshape(tuple(reversed(tensor.shape.tolist())))
    return tensors


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [(model_type, {}) for model_type in MODEL_TYPES] + list(_VARIANTS.values()),
    ids=MODEL_TYPES + list(_VARIANTS),
)
def test_llama_cpp_computes_the_float_model_from_a_float32_file(tmp_path, model_type, overrides) -> None:
    """Every tensor in F32: llama.cpp's graph (names, norms and their `1 + weight`, multipliers, soft-caps, sliding
    windows, rotary layout and bases, routing) gives transformers' logits up to its float16 KV cache."""
    model = _spread_model(model_type, **overrides)
    to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer(), fallback_type="F32")
    error, _, _ = _relative_error(model, tmp_path / "tiny.gguf")
    assert error < 2e-3


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_llama_cpp_runs_the_quantized_model_and_agrees_with_quantlab(tmp_path, model_type) -> None:
    """The same codes in Q4_0 (the embedding table's in Q8_0, Gemma's float one in F32): llama.cpp rounds
    activations to 8 bits per block before its products (quantlab multiplies in float32), a few percent of the
    logits' norm at most here; a misplaced row, half or scale moves them entirely."""
    model, fallback = _quantized(model_type)
    result = to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer(), fallback_type=fallback)
    assert result.requantized == []
    error, theirs, ours = _relative_error(model, tmp_path / "tiny.gguf")
    assert error < 0.1
    top_two = np.sort(ours, axis=-1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > 0.05 * np.abs(top_two).max()
    assert clear.sum() >= len(PROMPT) // 2
    assert (theirs.argmax(-1) == ours.argmax(-1))[clear].all()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_each_quantized_linears_codes_are_written_unchanged(tmp_path, model_type) -> None:
    """Every quantized Linear (Phi-3's fused `qkv_proj` and `gate_up_proj` too) decodes from the file to quantlab's
    weight, in llama.cpp's row order (Granite's q/k rows interleaved for its rotary layout)."""
    model, fallback = _quantized(model_type)
    to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer(), fallback_type=fallback)
    tensors = _read(tmp_path / "tiny.gguf")
    architecture = architecture_of(model)
    config = model.config
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, QuantizedLinear)]
    assert len(linears) >= 2 * config.num_hidden_layers
    for module_name, module in linears:
        base = gguf_name(module_name, architecture)
        expected = module.dequantize_weight(torch.float32)
        if architecture.rope_permuted and base.endswith(".attn_q"):
            expected = expected[rope_rows(expected.shape[0], config.num_attention_heads)]
        if architecture.rope_permuted and base.endswith(".attn_k"):
            expected = expected[rope_rows(expected.shape[0], config.num_key_value_heads)]
        kind, values = tensors[base + ".weight"]
        assert kind == "Q4_0" and np.array_equal(values, expected.numpy()), module_name


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_norms_are_stored_as_one_plus_weight(tmp_path, model_type) -> None:
    model = _spread_model(model_type)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0, 0.1)
    to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer(), fallback_type="F32")
    tensors = _read(tmp_path / "tiny.gguf")
    layer = model.model.layers[0]
    norms = {
        "output_norm": model.model.norm,
        "blk.0.attn_norm": layer.input_layernorm,
        "blk.0.post_attention_norm": layer.post_attention_layernorm,
        "blk.0.ffn_norm": layer.pre_feedforward_layernorm,
        "blk.0.post_ffw_norm": layer.post_feedforward_layernorm,
    }
    if model_type == "gemma3_text":
        norms |= {"blk.0.attn_q_norm": layer.self_attn.q_norm, "blk.0.attn_k_norm": layer.self_attn.k_norm}
    for name, norm in norms.items():
        kind, values = tensors[name + ".weight"]
        assert kind == "F32" and np.array_equal(values, (1 + norm.weight.detach()).numpy()), name


def test_architecture_keys_are_written(tmp_path) -> None:
    expected = {
        "granite": {
            "granite.embedding_scale": 12.0,
            "granite.residual_scale": 0.22,
            "granite.attention.scale": 0.2,
            "granite.logit_scale": 8.0,
        },
        "gemma2": {
            "gemma2.attn_logit_softcapping": 50.0,
            "gemma2.final_logit_softcapping": 30.0,
            "gemma2.attention.sliding_window": 4,
        },
        "gemma3_text": {"gemma3.attention.sliding_window": 4, "gemma3.rope.freq_base_swa": 10000.0},
        "phi3": {"phi3.attention.sliding_window": 0, "phi3.rope.scaling.original_context_length": 4096},
        "olmoe": {"olmoe.expert_count": 4, "olmoe.expert_used_count": 2, "olmoe.feed_forward_length": 128},
    }
    for model_type, keys in expected.items():
        path = tmp_path / f"{model_type}.gguf"
        to_gguf(_spread_model(model_type), path, tokenizer=byte_tokenizer())
        fields = gguf.GGUFReader(path).fields
        for key, value in keys.items():
            assert fields[key].contents() == pytest.approx(value), key
    olmoe = gguf.GGUFReader(tmp_path / "olmoe.gguf").fields
    assert "olmoe.expert_feed_forward_length" not in olmoe  # OLMoE's experts are intermediate_size wide


@pytest.mark.parametrize(
    ("model_type", "overrides", "message"),
    [
        ("olmoe", {"norm_topk_prob": True}, r"olmoe graph never renormalizes .*norm_topk_prob=True"),
        ("olmoe", {"num_key_value_heads": 2}, r"as many key/value heads as query heads \(4\); this model has 2"),
        ("olmoe", {"clip_qkv": 8.0}, r"does not clip queries, keys and values; this model has clip_qkv=8.0"),
        ("phi3", {"sliding_window": 64}, r"phi3 graph ignores the sliding window; this model attends over 64 tokens"),
        ("gemma2", {"query_pre_attn_scalar": 256}, r"scales queries by 1/sqrt\(16\).*query_pre_attn_scalar=256"),
        ("gemma2", {"final_logit_softcapping": None}, r"always soft-caps; this model has final_logit_softcapping"),
        ("gemma2", {"sliding_window": None}, r"gemma2 graph needs the sliding layers' window; this model has none"),
        (
            "gemma2",
            {"layer_types": ["full_attention", "sliding_attention"]},
            r"full-attention layer every 2 layers.*layer_types=\['full_attention', 'sliding_attention'\]",
        ),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, r"gemma3 graph has no attention soft-cap"),
        ("gemma3_text", {"use_bidirectional_attention": True}, r"gemma3 graph is causal"),
        (
            "gemma3_text",
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                }
            },
            r"never scales the sliding-window layers' rotary",
        ),
    ],
    ids=[
        "olmoe-renormalized",
        "olmoe-gqa",
        "olmoe-clip",
        "phi3-window",
        "gemma2-scale",
        "gemma2-no-softcap",
        "gemma2-no-window",
        "gemma2-pattern",
        "gemma3-softcap",
        "gemma3-bidirectional",
        "gemma3-scaled-local-rope",
    ],
)
def test_settings_llama_cpp_cannot_express_are_refused(tmp_path, model_type, overrides, message) -> None:
    model = _spread_model(model_type, **overrides)
    with pytest.raises(GGUFExportError, match=message) as refusal:
        to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    assert "\n" not in str(refusal.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("model_type", ["opt", "gpt_neox", "falcon"])
def test_other_model_types_are_refused_in_one_line_naming_the_supported_ones(tmp_path, model_type) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    with pytest.raises(GGUFExportError, match=r"supported model types: .*olmoe, granite, phi3, gemma2") as refusal:
        to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    assert "\n" not in str(refusal.value) and f"a {model_type} model cannot be written as GGUF" in str(refusal.value)
    assert not list(tmp_path.iterdir())
