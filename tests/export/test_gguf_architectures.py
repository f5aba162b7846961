"""`to_gguf` on OLMoE, Granite, Phi-3, Gemma 2, Gemma 3, OLMo 2, GPT-2, GPT-NeoX, Falcon and DeepSeek V3: llama.cpp
itself (llama-cpp-python) computes transformers' logits from a float32 file and quantlab's from a 4-bit one, every
quantized Linear's codes land in the file unchanged (in llama.cpp's row order where it reorders a fused projection),
Gemma's norms are stored as `1 + weight`, and settings llama.cpp's graphs cannot express are refused in one line,
writing nothing."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM  # noqa: E402

import quantlab  # noqa: E402
from quantlab.export.gguf import GGUFExportError, to_gguf  # noqa: E402
from quantlab.export.gguf.architectures import (  # noqa: E402
    architecture_of,
    fused_qkv_rows,
    gguf_name,
    permutation,
    rope_rows,
)
from quantlab.nn import QuantizedLinear  # noqa: E402
from quantlab.testing.architectures import tiny_config  # noqa: E402
from quantlab.testing.gguf_files import LLAMA_CPP_PROMPT, llama_cpp_logits, read_gguf_tensors  # noqa: E402
from quantlab.testing.tokenizer import byte_tokenizer  # noqa: E402

SYMMETRIC_4 = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, scale_dtype="float16", embedding_bits=8)
# Gemma's embedding table scales its rows (`Gemma2TextScaledWordEmbedding`), which `embedding_bits` does not quantize:
# the table stays float, written in F32.
LINEARS_ONLY = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, scale_dtype="float16")
PROMPT = LLAMA_CPP_PROMPT
MODEL_TYPES = [
    "olmoe",
    "granite",
    "phi3",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "gpt2",
    "gpt_neox",
    "falcon",
    "deepseek_v3",
]

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
    # a latent of 32 fills Q4_0's blocks of 32, so kv_b_proj's codes land unchanged (16 is re-quantized, see below)
    "deepseek_v3": {"kv_lora_rank": 32},
}
# Variants that reach further parts of the graphs.
# DeepSeek-V3's rotary scaling as its checkpoints set it (on the tiny config's 32 positions)
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
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
    "gpt2-untied": ("gpt2", {"tie_word_embeddings": False}),
    "gpt_neox-sequential": ("gpt_neox", {"use_parallel_residual": False}),
    # one key/value head per query head, interleaved per head as GPT-NeoX's; and Falcon 40B's grouped layout
    "falcon-per-head": ("falcon", {"multi_query": False}),
    "falcon-grouped": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    # experts chosen within the best 2 of 4 groups (the router's correction bias, drawn, changes which)
    "deepseek_v3-groups": ("deepseek_v3", {"n_group": 4, "topk_group": 2}),
    "deepseek_v3-unnormalized": ("deepseek_v3", {"norm_topk_prob": False}),
    "deepseek_v3-yarn": (
        "deepseek_v3",
        {"rope_parameters": _YARN},
    ),
    "deepseek_v3-no-q-lora": ("deepseek_v3", {"q_lora_rank": None}),
}


def _config(model_type: str, **overrides):
    config = tiny_config(model_type)
    for name, value in {**_FOR_LLAMA_CPP.get(model_type, {}), **overrides}.items():
        setattr(config, name, value)
    return config


def _spread_model(model_type: str, **overrides):
    """A seeded float model with weights spread wide enough (0.1; GPT-2, whose initialization narrows its output
    projections, 0.15) for its most likely tokens to be clear, and DeepSeek's router correction bias (zero when
    initialized) drawn, so that it changes which experts are chosen."""
    torch.manual_seed(0)
    spread = 0.15 if model_type == "gpt2" else 0.1
    model = AutoModelForCausalLM.from_config(_config(model_type, initializer_range=spread, **overrides)).eval()
    generator = torch.Generator().manual_seed(3)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.1)
    return model


def _llama_cpp_logits(path) -> np.ndarray:
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (the peers extra)")
    return llama_cpp_logits(path, PROMPT)


def _quantized(model_type: str, **overrides):
    """The spread model quantized to 4-bit symmetric g32, and the fallback type its float tables need (F32 for
    Gemma's, which stay float; Q8_0 tables from int8 codes otherwise; GPT-2's position table is F32 always)."""
    gemma = model_type.startswith("gemma")
    config = LINEARS_ONLY if gemma else SYMMETRIC_4
    model = quantlab.quantize(_spread_model(model_type, **overrides), config, progress=False)
    return model, "F32" if gemma else None


def _relative_error(model, path) -> tuple[float, np.ndarray, np.ndarray]:
    theirs = _llama_cpp_logits(path)
    with torch.no_grad():
        ours = model(torch.tensor([PROMPT])).logits[0].numpy()
    return float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours)), theirs, ours


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


@pytest.mark.parametrize("model_type", [*MODEL_TYPES, "falcon-grouped"])
def test_each_quantized_linears_codes_are_written_unchanged(tmp_path, model_type) -> None:
    """Every quantized Linear (Phi-3's fused `qkv_proj` and `gate_up_proj` too, GPT-2's Conv1D layers) decodes from
    the file to quantlab's weight, in llama.cpp's row order (Granite's q/k rows interleaved for its rotary layout,
    GPT-NeoX's and Falcon's fused rows regrouped as queries, keys, values)."""
    model_type, overrides = _VARIANTS.get(model_type, (model_type, {}))
    model, fallback = _quantized(model_type, **overrides)
    to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer(), fallback_type=fallback)
    tensors = read_gguf_tensors(tmp_path / "tiny.gguf")
    architecture = architecture_of(model)
    config = model.config
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, QuantizedLinear)]
    assert len(linears) >= 2 * config.num_hidden_layers
    for module_name, module in linears:
        base = gguf_name(module_name, architecture)
        expected = module.dequantize_weight(torch.float32)
        order = permutation(architecture, config, base, expected.shape[0])
        if order is not None:
            expected = expected[order]
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
    tensors = read_gguf_tensors(tmp_path / "tiny.gguf")
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
        "gpt2": {
            "gpt2.feed_forward_length": 128,
            "gpt2.context_length": 128,
            "gpt2.attention.layer_norm_epsilon": 1e-5,
        },
        "gpt_neox": {
            "gptneox.use_parallel_residual": True,
            "gptneox.rope.dimension_count": 4,  # a quarter of each 16-wide head rotates
            "gptneox.attention.layer_norm_epsilon": 1e-5,
        },
        "falcon": {"falcon.attention.head_count_kv": 1, "falcon.feed_forward_length": 256},
        "deepseek_v3": {
            "deepseek2.leading_dense_block_count": 1,
            "deepseek2.attention.q_lora_rank": 32,
            "deepseek2.attention.kv_lora_rank": 32,
            "deepseek2.attention.key_length": 16,
            "deepseek2.attention.value_length": 16,
            "deepseek2.attention.head_count_kv": 4,
            "deepseek2.rope.dimension_count": 8,
            "deepseek2.expert_shared_count": 1,
            "deepseek2.expert_weights_scale": 2.5,
            "deepseek2.expert_weights_norm": True,
            "deepseek2.expert_gating_func": 2,  # sigmoid
            "deepseek2.expert_group_count": 1,
        },
    }
    for model_type, keys in expected.items():
        path = tmp_path / f"{model_type}.gguf"
        to_gguf(_spread_model(model_type), path, tokenizer=byte_tokenizer())
        fields = gguf.GGUFReader(path).fields
        for key, value in keys.items():
            assert fields[key].contents() == pytest.approx(value), key
    olmoe = gguf.GGUFReader(tmp_path / "olmoe.gguf").fields
    assert "olmoe.expert_feed_forward_length" not in olmoe  # OLMoE's experts are intermediate_size wide
    assert gguf.GGUFReader(tmp_path / "falcon.gguf").fields["falcon.tensor_data_layout"].contents() == "jploski"
    deepseek = gguf.GGUFReader(tmp_path / "deepseek_v3.gguf").fields
    assert "deepseek2.attention.key_length_mla" not in deepseek  # per-head keys and values: `attn_kv_b` decompresses


def test_fused_rows_are_regrouped_as_queries_keys_values() -> None:
    """Heads of one row each: GPT-NeoX interleaves q, k, v per head; Falcon groups each key/value head's queries
    before it; llama.cpp reads every query, then every key, then every value."""
    assert fused_qkv_rows(6, groups=2, dim=1).tolist() == [0, 3, 1, 4, 2, 5]  # q0 k0 v0 q1 k1 v1
    assert fused_qkv_rows(8, groups=2, dim=1).tolist() == [0, 1, 4, 5, 2, 6, 3, 7]  # q0 q1 k0 v0 q2 q3 k1 v1
    assert fused_qkv_rows(12, groups=1, dim=2).tolist() == list(range(12))  # multi-query: already in order
    assert rope_rows(4, heads=1).tolist() == [0, 2, 1, 3]


def test_gpt2_position_table_stays_float32(tmp_path) -> None:
    """The learned positions stay F32 whatever the fallback type, as llama.cpp's converter keeps them."""
    model, _ = _quantized("gpt2")
    result = to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer(), fallback_type="Q8_0")
    kind, values = read_gguf_tensors(tmp_path / "tiny.gguf")["position_embd.weight"]
    assert kind == "F32" and np.array_equal(values, model.transformer.wpe.weight.detach().numpy())
    assert result.requantized == []


def test_deepseek_latent_narrower_than_a_block_is_requantized_and_reported(tmp_path) -> None:
    """A latent of 16 (`kv_b_proj`'s input) has no whole Q4_0 block: those matrices are written from quantlab's
    dequantized weights in F16 and reported, the rest from their codes; llama.cpp still runs the file."""
    model, _ = _quantized("deepseek_v3", kv_lora_rank=16)
    result = to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    assert [tensor.name for tensor in result.requantized] == ["blk.0.attn_kv_b.weight", "blk.1.attn_kv_b.weight"]
    assert all(
        tensor.type == "F16" and "do not split into the 32-weight blocks" in tensor.reason
        for tensor in result.requantized
    )
    error, _, _ = _relative_error(model, tmp_path / "tiny.gguf")
    assert error < 0.1


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
        ("gpt2", {"activation_function": "relu"}, r"gpt2 graph's MLP computes GELU; .*activation_function='relu'"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, r"scales attention scores by 1/sqrt\(head_dim\) only"),
        ("gpt_neox", {"hidden_act": "silu"}, r"gptneox graph's MLP computes GELU; this model has hidden_act='silu'"),
        ("gpt_neox", {"attention_bias": False}, r"gptneox graph needs the attention's biases"),
        ("falcon", {"alibi": True}, r"falcon graph has rotary positions, not ALiBi"),
        ("falcon", {"parallel_attn": False}, r"falcon graph runs attention and MLP in parallel"),
        ("falcon", {"bias": True}, r"falcon graph has no biases on its projections"),
        ("deepseek_v3", {"rope_interleave": False}, r"deepseek2 graph rotates interleaved pairs"),
        (
            "deepseek_v3",
            {"rope_parameters": {**_YARN, "mscale": 0.707}},
            r"only when mscale equals mscale_all_dim; this model has mscale=0.707",
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
        "gpt2-relu",
        "gpt2-inverse-layer-scale",
        "gpt_neox-silu",
        "gpt_neox-no-attention-bias",
        "falcon-alibi",
        "falcon-sequential",
        "falcon-bias",
        "deepseek_v3-half-split-rope",
        "deepseek_v3-yarn-mscale",
    ],
)
def test_settings_llama_cpp_cannot_express_are_refused(tmp_path, model_type, overrides, message) -> None:
    model = _spread_model(model_type, **overrides)
    with pytest.raises(GGUFExportError, match=message) as refusal:
        to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    assert "\n" not in str(refusal.value)
    assert not list(tmp_path.iterdir())


def test_other_model_types_are_refused_in_one_line_naming_the_supported_ones(tmp_path) -> None:
    model_type = "opt"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    supported = r"supported model types: .*olmoe, granite, phi3, gemma2, .*gpt2, gpt_neox, falcon, deepseek_v3"
    with pytest.raises(GGUFExportError, match=supported) as refusal:
        to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    assert "\n" not in str(refusal.value) and f"a {model_type} model cannot be written as GGUF" in str(refusal.value)
    assert not list(tmp_path.iterdir())
