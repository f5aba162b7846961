"""A mixture of experts streamed block by block: its per-expert checkpoint tensors read into the fused experts
of one block at a time, quantized as loading quantizes them, resumable."""

import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantlab.loading import model_class
from quantlab.methods.custom_bits import CustomBitsConfig
from quantlab.nn.quantized_experts import QuantizedExperts
from quantlab.streaming.partial import PartialOutput
from quantlab.streaming.quantize import quantize_checkpoint
from quantlab.testing import byte_tokenizer
from quantlab.testing.architectures import tiny_causal_lm

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])
CONFIGS = {
    "rtn": {"bits": 4, "group_size": 32},
    "gptq": {"bits": 4, "group_size": 32, "solver": "gptq", "calibration_samples": 4, "calibration_seq_len": 32},
    "awq": {"bits": 3, "group_size": 32, "awq": True, "calibration_samples": 4, "calibration_seq_len": 32},
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folders = {}
    for model_type in ("mixtral", "qwen3_moe"):
        folder = tmp_path_factory.mktemp(model_type) / "float"
        tiny_causal_lm(model_type).save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
        folders[model_type] = folder
    return folders


def _streamed(source: Path, options: dict, output: Path, resume: bool = False) -> None:
    config = AutoConfig.from_pretrained(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experts given few of the 128 calibration tokens are named: tested elsewhere
        quantize_checkpoint(
            source, config, model_class(config), CustomBitsConfig(**options), output, tokenizer=byte_tokenizer(),
            resume=resume,
        )  # fmt: skip


@pytest.mark.parametrize("solver", list(CONFIGS))
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_streamed_experts_equal_the_loaded_ones(model_type, solver, sources, tmp_path):
    source = sources[model_type]
    _streamed(source, CONFIGS[solver], tmp_path / "out")
    streamed = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert isinstance(streamed.model.layers[1].mlp.experts, QuantizedExperts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(source, quantization_config=CustomBitsConfig(**CONFIGS[solver]))
    assert torch.equal(streamed(PROMPT).logits, loaded(PROMPT).logits)


def test_an_interrupted_run_resumes_from_the_quantized_experts(sources, tmp_path, monkeypatch):
    source = sources["mixtral"]
    _streamed(source, CONFIGS["gptq"], tmp_path / "straight")
    complete = PartialOutput.complete

    def stop_after_the_first_block(self, name, digest):
        complete(self, name, digest)
        if name == "model.layers.0":
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(PartialOutput, "complete", stop_after_the_first_block)
        with pytest.raises(KeyboardInterrupt):
            _streamed(source, CONFIGS["gptq"], tmp_path / "out")
    _streamed(source, CONFIGS["gptq"], tmp_path / "out", resume=True)
    straight, resumed = (AutoModelForCausalLM.from_pretrained(tmp_path / name) for name in ("straight", "out"))
    assert torch.equal(straight(PROMPT).logits, resumed(PROMPT).logits)
