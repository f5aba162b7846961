"""`OnnxCausalLM` generates what the PyTorch quantized model generates, with and without a cache."""

import pytest
import torch

import quantlab
from quantlab.export import OnnxCausalLM, to_onnx
from quantlab.testing import tiny_llama

PROMPTS = [[5, 17, 200], [42], [1, 2, 3, 4, 5, 6, 7], [255, 0, 128, 64], [99, 98]]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def quantized_llama():
    return quantlab.quantize(tiny_llama(), quantlab.CustomBitsConfig(bits=4, group_size=64))


@pytest.fixture(scope="module")
def exported(quantized_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("generation") / "with_past.onnx"
    result = to_onnx(quantized_llama, path, with_past=True)
    return result


def _torch_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0].tolist()


def test_export_with_past_names_the_cache(exported) -> None:
    assert exported.input_names[:2] == ["input_ids", "attention_mask"]
    assert exported.input_names[2:] == [f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")]
    assert exported.output_names == ["logits"] + [f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value")]
    assert exported.operators["com.microsoft::MatMulNBits"] == 14


def test_greedy_tokens_equal_pytorch_on_five_prompts(quantized_llama, exported) -> None:
    onnx_model = OnnxCausalLM(exported.path)
    assert onnx_model.with_past
    for prompt in PROMPTS:
        tokens = onnx_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
        assert tokens[0].tolist() == _torch_greedy(quantized_llama, prompt)


def test_left_padded_batch_generates_each_prompt_as_alone(exported) -> None:
    onnx_model = OnnxCausalLM(exported.path)
    length = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (length - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in PROMPTS])
    batch = onnx_model.generate(ids, mask, max_new_tokens=8)
    for row, prompt in zip(batch, PROMPTS, strict=True):
        alone = onnx_model.generate(torch.tensor([prompt]), max_new_tokens=8)[0]
        assert row[length:].tolist() == alone[len(prompt) :].tolist()


def test_cached_logits_equal_full_sequence_logits(quantized_llama, exported) -> None:
    onnx_model = OnnxCausalLM(exported.path)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        reference = quantized_llama(ids).logits
    assert float((onnx_model(ids) - reference).abs().max()) <= 1e-3


def test_sampling_is_seeded_and_top_k_one_is_greedy(exported) -> None:
    onnx_model = OnnxCausalLM(exported.path)
    prompt = torch.tensor([PROMPTS[0]])
    first = onnx_model.generate(prompt, do_sample=True, temperature=1.5, top_p=0.9, seed=7, max_new_tokens=12)
    again = onnx_model.generate(prompt, do_sample=True, temperature=1.5, top_p=0.9, seed=7, max_new_tokens=12)
    other = onnx_model.generate(prompt, do_sample=True, temperature=1.5, top_p=0.9, seed=8, max_new_tokens=12)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    greedy = onnx_model.generate(prompt, max_new_tokens=12)
    assert torch.equal(onnx_model.generate(prompt, do_sample=True, top_k=1, seed=3, max_new_tokens=12), greedy)


def test_generation_stops_at_eos_and_pads(exported) -> None:
    onnx_model = OnnxCausalLM(exported.path)
    prompt = torch.tensor([PROMPTS[2]])
    greedy = onnx_model.generate(prompt, max_new_tokens=6)[0].tolist()
    eos = greedy[len(PROMPTS[2]) + 1]  # the second generated token
    stopped = onnx_model.generate(prompt, max_new_tokens=6, eos_token_id=eos)[0].tolist()
    assert stopped == greedy[: len(PROMPTS[2]) + 2]


def test_export_without_past_generates_the_same_tokens(quantized_llama, exported, tmp_path) -> None:
    result = to_onnx(quantized_llama, tmp_path / "no_past.onnx")
    assert result.input_names == ["input_ids", "attention_mask"]
    no_cache = OnnxCausalLM(result.path)
    assert not no_cache.with_past
    prompt = torch.tensor([PROMPTS[0]])
    assert torch.equal(
        no_cache.generate(prompt, max_new_tokens=8), OnnxCausalLM(exported.path).generate(prompt, max_new_tokens=8)
    )
