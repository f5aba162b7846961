"""Every architecture people quantize, on tiny configs: planned whole, quantized while loading, calibrated,
streamed, saved, reloaded bit-identical in a fresh process, generating."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.methods.custom_bits import CustomBitsConfig
from quantlab.plan import build_plan
from quantlab.testing import byte_tokenizer
from quantlab.testing.architectures import ARCHITECTURES, MIXTURES_OF_EXPERTS, tiny_causal_lm
from quantlab.workflows.quantize import quantize_to_checkpoint

RTN = {"bits": 4, "group_size": 32}
GPTQ = {**RTN, "solver": "gptq", "calibration_samples": 4, "calibration_seq_len": 32}
PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each architecture's float checkpoint, with a tokenizer, and its checkpoint quantized while loading."""
    folders = {}
    root = tmp_path_factory.mktemp("architectures")
    for model_type in ARCHITECTURES:
        tiny_causal_lm(model_type).save_pretrained(root / model_type / "float")
        byte_tokenizer().save_pretrained(root / model_type / "float")
        quantized = AutoModelForCausalLM.from_pretrained(
            root / model_type / "float", quantization_config=CustomBitsConfig(**RTN)
        )
        quantized.save_pretrained(root / model_type / "rtn")
        torch.save(quantized(PROMPT).logits, root / model_type / "rtn" / "logits.pt")
        folders[model_type] = root / model_type
    return folders


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_every_weight_outside_the_vocabulary_is_planned(model_type: str) -> None:
    plan = build_plan(tiny_causal_lm(model_type), CustomBitsConfig(**RTN))
    assert not plan.unhandled()
    assert plan.quantized_share() >= 0.99  # the rest: routers, kept in float on purpose and listed
    assert all("router" in w.why or w.vocabulary for w in plan.left_float)
    assert bool(plan.experts_modules) == (model_type in MIXTURES_OF_EXPERTS)


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_loading_quantizes_what_quantize_does_and_generates(model_type: str, saved: dict[str, Path]) -> None:
    converted = quantlab.quantize(tiny_causal_lm(model_type), CustomBitsConfig(**RTN), progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(saved[model_type] / "rtn")
    state = converted.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in loaded.state_dict().items())
    assert torch.equal(loaded(PROMPT).logits, torch.load(saved[model_type] / "rtn" / "logits.pt"))
    generated = loaded.generate(PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, PROMPT.shape[1] + 3)


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_gptq_calibrates_every_architecture(model_type: str) -> None:
    model = tiny_causal_lm(model_type)
    reference = model(PROMPT).logits
    windows = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the few experts 128 tokens leave without enough are named: tested elsewhere
        quantlab.quantize(model, CustomBitsConfig(**GPTQ), calibration=windows, progress=False)
    logits = model(PROMPT).logits
    assert torch.isfinite(logits).all() and not torch.equal(logits, reference)


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_the_quantize_workflow_writes_a_checkpoint_that_reloads(
    model_type: str, saved: dict[str, Path], tmp_path
) -> None:
    report = quantize_to_checkpoint(saved[model_type] / "float", CustomBitsConfig(**RTN), tmp_path / "out")
    assert report.left_in_float == {} and report.plan["quantized_share"] >= 0.99
    reference = torch.load(saved[model_type] / "rtn" / "logits.pt")
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "out")(PROMPT).logits, reference)


RELOAD_ALL = """
import sys, torch
from transformers import AutoModelForCausalLM
prompt = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])
for folder in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(folder)
    if not torch.equal(model(prompt).logits, torch.load(folder + "/logits.pt")):
        sys.exit(f"{folder}: logits differ")
    if not any(hasattr(module, "stored_bytes") for module in model.modules()):
        sys.exit(f"{folder}: nothing quantized after reloading")
"""


def test_every_architecture_reloads_bit_identical_in_a_fresh_process(saved: dict[str, Path]) -> None:
    folders = [str(saved[model_type] / "rtn") for model_type in ARCHITECTURES]
    result = subprocess.run([sys.executable, "-c", RELOAD_ALL, *folders], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
