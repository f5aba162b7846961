"""`to_gguf` on mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral) and Qwen3: each expert's codes packed
into llama.cpp's 3-D `ffn_*_exps` tensors unchanged, routers in F32, the experts' keys, and the file read back
by an independent reader (transformers' GGUF loader, which dequantizes with gguf-py) computing quantlab's logits."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM  # noqa: E402

import quantlab  # noqa: E402
from quantlab.export.gguf import GGUFExportError, to_gguf  # noqa: E402
from quantlab.methods.int8 import Int8SymmetricConfig  # noqa: E402
from quantlab.nn.quantized_experts import QuantizedExperts  # noqa: E402
from quantlab.testing.architectures import tiny_config  # noqa: E402
from quantlab.testing.gguf_files import LLAMA_CPP_PROMPT, llama_cpp_logits, read_gguf_tensors  # noqa: E402
from quantlab.testing.tokenizer import byte_tokenizer  # noqa: E402

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])
SYMMETRIC_4 = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, scale_dtype="float16", embedding_bits=8)
INT8 = Int8SymmetricConfig(group_size=32, scale_dtype="float16", embedding_bits=8)


def _config(model_type: str, **overrides):
    config = tiny_config(model_type)
    if model_type == "qwen3_moe":
        config.norm_topk_prob = True  # llama.cpp's qwen3moe graph always renormalizes (Qwen3-30B-A3B's setting)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def _quantized(model_type: str, config: quantlab.QuantlabConfig = SYMMETRIC_4, **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(model_type, **overrides)).eval()
    return quantlab.quantize(model, config, progress=False)


@pytest.mark.parametrize(
    ("model_type", "config", "kind"),
    [
        ("qwen3_moe", SYMMETRIC_4, "Q4_0"),
        ("qwen3_moe", INT8, "Q8_0"),
        ("qwen2_moe", SYMMETRIC_4, "Q4_0"),
        ("qwen3", SYMMETRIC_4, "Q4_0"),
    ],
    ids=["qwen3_moe-sym4", "qwen3_moe-int8", "qwen2_moe-sym4", "qwen3-sym4"],
)
def test_the_file_computes_quantlabs_logits_when_read_back(tmp_path, model_type, config, kind) -> None:
    """transformers' GGUF loader builds the model from the file alone (given the tiny config, which its key
    mapping does not fully recover) and dequantizes every tensor with gguf-py: same logits up to float sums."""
    model = _quantized(model_type, config)
    result = to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    assert result.requantized == []
    assert {tensor.type for tensor in result.tensors if len(tensor.shape) == 3} <= {kind}
    read = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", config=_config(model_type)).eval()
    with torch.no_grad():
        ours, theirs = model(PROMPT).logits, read(PROMPT).logits
    assert torch.allclose(theirs, ours, rtol=0, atol=1e-5 * ours.abs().max().item())


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_each_experts_codes_are_written_unchanged(tmp_path, model_type) -> None:
    model = _quantized(model_type)
    to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    tensors = read_gguf_tensors(tmp_path / "tiny.gguf")
    for block, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        assert isinstance(experts, QuantizedExperts)
        gate, up = experts.dequantize_projection("gate_up_proj").chunk(2, dim=1)
        down = experts.dequantize_projection("down_proj")
        for name, expected in (("gate", gate), ("up", up), ("down", down)):
            kind, values = tensors[f"blk.{block}.ffn_{name}_exps.weight"]
            assert kind == "Q4_0" and values.shape == tuple(expected.shape)
            assert np.array_equal(values, expected.numpy())
        kind, router = tensors[f"blk.{block}.ffn_gate_inp.weight"]
        assert kind == "F32" and np.array_equal(router, layer.mlp.gate.weight.detach().numpy())


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("qwen3_moe", {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2}),
        ("qwen2_moe", {"qwen2moe.expert_shared_feed_forward_length": 64, "qwen2moe.expert_count": 8}),
        ("mixtral", {"llama.expert_count": 4, "llama.expert_used_count": 2, "llama.feed_forward_length": 128}),
    ],
)
def test_the_experts_keys_are_written(tmp_path, model_type, expected) -> None:
    to_gguf(_quantized(model_type), tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    fields = gguf.GGUFReader(tmp_path / "tiny.gguf").fields
    for key, value in expected.items():
        assert fields[key].contents() == value, key
    if model_type == "qwen3_moe":
        assert fields["qwen3moe.expert_feed_forward_length"].contents() == 32


def test_float_experts_are_rounded_into_the_fallback_type_and_reported(tmp_path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("qwen3_moe")).eval()
    result = to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    experts = [tensor for tensor in result.tensors if tensor.name.endswith("_exps.weight")]
    assert len(experts) == 6 and {tensor.type for tensor in experts} == {"F16"}
    assert all(tensor.requantized and tensor.origin == "float" for tensor in experts)


def test_other_routing_than_llama_cpps_is_refused(tmp_path) -> None:
    with pytest.raises(GGUFExportError, match=r"renormalizes the routed experts' weights.*norm_topk_prob=False"):
        to_gguf(_quantized("qwen3_moe", norm_topk_prob=False), tmp_path / "a.gguf", tokenizer=byte_tokenizer())
    with pytest.raises(GGUFExportError, match=r"needs experts in every block.*mlp_only_layers=\[0\]"):
        to_gguf(_quantized("qwen3_moe", mlp_only_layers=[0]), tmp_path / "b.gguf", tokenizer=byte_tokenizer())
    assert not list(tmp_path.iterdir())


# -- llama.cpp itself (llama-cpp-python, the `peers` extra) --------------------------------------------------


def _llama_cpp_logits(path) -> np.ndarray:
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (the peers extra)")
    return llama_cpp_logits(path)


def _spread_model(model_type: str):
    """A seeded float model with weights spread wide enough (0.1) for its most likely tokens to be clear."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(model_type, initializer_range=0.1)).eval()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe", "qwen3", "mistral"])
def test_llama_cpp_computes_the_float_model_from_a_float32_file(tmp_path, model_type) -> None:
    """Every tensor in F32: llama.cpp's graph (routing, renormalization, shared expert, q/k norms, rotary layout)
    gives transformers' logits up to its float16 KV cache; a wrong name, order or routing rule would not."""
    model = _spread_model(model_type)
    to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer(), fallback_type="F32")
    theirs = _llama_cpp_logits(tmp_path / "tiny.gguf")
    with torch.no_grad():
        ours = model(torch.tensor([LLAMA_CPP_PROMPT])).logits[0].numpy()
    assert np.linalg.norm(theirs - ours) / np.linalg.norm(ours) < 2e-3


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_llama_cpp_runs_the_quantized_experts_and_agrees_with_quantlab(tmp_path, model_type) -> None:
    """Same codes, different arithmetic: llama.cpp rounds activations to 8 bits per block of 32 before its Q4_0
    products (quantlab multiplies in float32), which moves the logits by a few percent of their norm on these
    tiny models; a misplaced expert, half or scale moves them entirely."""
    model = quantlab.quantize(_spread_model(model_type), SYMMETRIC_4, progress=False)
    result = to_gguf(model, tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    assert result.requantized == []
    theirs = _llama_cpp_logits(tmp_path / "tiny.gguf")
    with torch.no_grad():
        ours = model(torch.tensor([LLAMA_CPP_PROMPT])).logits[0].numpy()
    assert np.linalg.norm(theirs - ours) / np.linalg.norm(ours) < 0.1
    top_two = np.sort(ours, axis=-1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > 0.05
    assert clear.sum() >= len(LLAMA_CPP_PROMPT) // 2
    assert (theirs.argmax(-1) == ours.argmax(-1))[clear].all()
