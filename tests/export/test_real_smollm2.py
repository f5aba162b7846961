"""SmolLM2-135M 4-bit through ONNX: greedy tokens and logits equal PyTorch's (slow: one real export)."""

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Photosynthesis is the process by which",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics state that",
]


@pytest.fixture(scope="module")
def smollm2_4bit(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quantlab
    from quantlab.assets.models import smollm2_dir
    from quantlab.export import OnnxCausalLM, to_onnx

    directory = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    quantlab.quantize(model, quantlab.CustomBitsConfig(bits=4, group_size=64))
    path = tmp_path_factory.mktemp("smollm2") / "smollm2-4bit.onnx"
    result = to_onnx(model, path, with_past=True)
    return model, AutoTokenizer.from_pretrained(directory), OnnxCausalLM(path, threads=2), result


def test_export_stores_4_bit_weights_and_one_fp32_embedding(smollm2_4bit) -> None:
    _, _, _, result = smollm2_4bit
    assert result.layer_operators and set(result.layer_operators.values()) == {"MatMulNBits"}
    assert len(result.layer_operators) == 210
    # 106M weights at 4 bits + float32 scale and zero shift per 64 (66 MB), the 28M-weight tied
    # embedding in fp32 once (113 MB): 0.33x of the 538 MB fp32 export.
    assert 175e6 < result.bytes < 185e6


def test_greedy_tokens_equal_pytorch(smollm2_4bit) -> None:
    model, tokenizer, onnx_model, _ = smollm2_4bit
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
        assert torch.equal(onnx_model.generate(ids, max_new_tokens=20), expected), prompt


def test_logits_of_a_perplexity_window_within_1e3(smollm2_4bit) -> None:
    from quantlab.assets.text import bundled_text
    from quantlab.eval.perplexity import token_ids

    model, tokenizer, onnx_model, _ = smollm2_4bit
    ids = torch.tensor([token_ids(tokenizer, bundled_text())[:512]])
    with torch.inference_mode():
        reference = model(ids).logits
    assert float((onnx_model(ids) - reference).abs().max()) <= 1e-3
