"""A damaged or edited quantized checkpoint is refused with one line naming the tensor, never run.

Each case edits a saved checkpoint the way a truncated download, a bad merge tool or a hand
edit would, and expects a `CheckpointError` (a `ValueError`) whose message names the tensor.
"""

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.errors import CheckpointError, ConfigError
from quantlab.testing.models import tiny_llama
from quantlab.testing.tokenizer import byte_tokenizer

LAYER = "model.layers.0.mlp.up_proj"


def _edit_tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        tensors = load_file(directory / "model.safetensors")
        edit(tensors)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})

    return apply


def _edit_config(option: str, value) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        config["quantization_config"][option] = value
        (directory / "config.json").write_text(json.dumps(config))

    return apply


def _set(key: str, value: float) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[0] = value

    return edit


CASES = [
    (
        "custom_bits",
        "scale deleted",
        _edit_tensors(lambda t: t.pop(f"{LAYER}.weight_scale")),
        "weight_scale is missing",
    ),
    ("custom_bits", "codes deleted", _edit_tensors(lambda t: t.pop(f"{LAYER}.weight")), "weight is missing"),
    ("custom_bits", "NaN scale", _edit_tensors(_set(f"{LAYER}.weight_scale", float("nan"))), "NaN/Inf"),
    ("custom_bits", "Inf zero point", _edit_tensors(_set(f"{LAYER}.weight_zero", float("inf"))), "NaN/Inf"),
    (
        "custom_bits",
        "codes cut short",
        _edit_tensors(lambda t: t.update({f"{LAYER}.weight": t[f"{LAYER}.weight"][:, :, :4].clone()})),
        r"weight in model.safetensors is uint8 \[192, 1, 4\] but its layout needs uint8 \[192, 1, 32\]",
    ),
    (
        "custom_bits",
        "scale dtype changed",
        _edit_tensors(lambda t: t.update({f"{LAYER}.weight_scale": t[f"{LAYER}.weight_scale"].float()})),
        "is float32 .* needs float16",
    ),
    ("custom_bits", "symmetric flipped", _edit_config("symmetric", True), "weight_zero is in the checkpoint but not"),
    ("custom_bits", "scale_dtype edited", _edit_config("scale_dtype", "bfloat16"), "needs bfloat16"),
    ("custom_bits", "bits edited", _edit_config("bits", 3), "layout needs uint8"),
    ("nf4", "double_quant flipped", _edit_config("double_quant", False), "weight_absmax is missing"),
    ("nf4", "NaN absmax scale", _edit_tensors(_set(f"{LAYER}.weight_absmax_scale", float("nan"))), "NaN/Inf"),
    ("int8", "group size edited", _edit_config("group_size", 32), "layout needs"),
    ("int8", "format_version not a number", _edit_config("format_version", "one"), "format_version='one'"),
]
CONFIGS = {
    "custom_bits": lambda: quantlab.CustomBitsConfig(bits=4, group_size=64),
    "nf4": quantlab.NF4Config,
    "int8": quantlab.Int8SymmetricConfig,
}


def _checkpoint(method: str, directory: Path) -> Path:
    model = tiny_llama()
    quantlab.quantize(model, CONFIGS[method]())
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    ("method", "edit", "message"), [(m, e, msg) for m, _, e, msg in CASES], ids=[c[1] for c in CASES]
)
def test_damaged_checkpoint_is_refused(method, edit, message, tmp_path):
    directory = _checkpoint(method, tmp_path / "checkpoint")
    AutoModelForCausalLM.from_pretrained(directory)  # intact: loads
    edit(directory)
    with pytest.raises((CheckpointError, ConfigError), match=message):
        AutoModelForCausalLM.from_pretrained(directory)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


@pytest.mark.subprocess
def test_cli_says_one_line_and_exits_2(tmp_path):
    directory = _checkpoint("custom_bits", tmp_path / "checkpoint")
    _edit_tensors(lambda t: t.pop(f"{LAYER}.weight_scale"))(directory)
    result = subprocess.run(
        [sys.executable, "-m", "quantlab.cli.main", "eval", str(directory), "--windows", "1", "--seq-len", "16"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and f"{LAYER}.weight_scale is missing" in errors[0]


def test_a_single_module_name_is_one_name():
    assert quantlab.NF4Config(modules_to_not_convert="lm_head").modules_to_not_convert == ["lm_head"]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_switches_must_be_booleans(value):
    with pytest.raises(ConfigError, match=r"double_quant=.* use true or false"):
        quantlab.NF4Config(double_quant=value)


def test_a_gpt2_model_is_quantized_not_left_in_float(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantlab.NF4Config())
    converted = quantlab.quantize(AutoModelForCausalLM.from_pretrained(tmp_path), quantlab.NF4Config(), progress=False)
    for model in (loaded, converted):
        assert not any(isinstance(module, Conv1D) for module in model.modules())
    state = converted.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in loaded.state_dict().items())
