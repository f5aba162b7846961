"""LoRA through PEFT on every quantlab method: wrapping, gradients, save/reload, merging."""

import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, PeftModel

from quantlab.config import QuantlabConfig
from quantlab.convert import quantize
from quantlab.errors import QuantlabError
from quantlab.integrations.peft.lora import QuantizedLoraLinear
from quantlab.nn import QuantizedLinear
from quantlab.registry import get_method, list_methods
from quantlab.replacement import quantized_layers
from quantlab.testing import tiny_llama
from quantlab.training import add_lora, merge_to_float, merge_to_quantized

CONFIGS = [get_method(name).config_class() for name in list_methods()]
IDS = [config.method for config in CONFIGS]


def _input(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))


def _logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(input_ids=x).logits


def test_every_lora_config_knows_quantlab_layers():
    assert LoraConfig(r=4)._custom_modules[QuantizedLinear] is QuantizedLoraLinear


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_lora_wraps_every_quantized_projection(config: QuantlabConfig, make_qlora):
    model = make_qlora(config)
    wrapped = [m for m in model.modules() if isinstance(m, QuantizedLoraLinear)]
    assert len(wrapped) == 14  # 7 projections x 2 layers
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_gradients_match_the_dequantized_float_model(config: QuantlabConfig, make_qlora):
    """The quantized path's input and LoRA gradients equal those of a float model holding the dequantized weights."""
    quantized = make_qlora(config)
    reference = make_qlora(config)
    for name, layer in quantized_layers(reference).items():
        parent, _, child = name.rpartition(".")
        setattr(reference.get_submodule(parent), child, layer.to_linear(torch.float32).requires_grad_(False))
    x = _input()
    losses = [m(input_ids=x, labels=x).loss for m in (quantized, reference)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (quantized, reference)]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_optimizer_step_changes_adapters_only(config: QuantlabConfig, make_qlora):
    model = make_qlora(config, checkpointing=True)
    stored = {n: b.clone() for n, b in model.named_buffers()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    x = _input()
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    assert all(torch.equal(b, stored[n]) for n, b in model.named_buffers())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_adapter_saves_and_reloads(config: QuantlabConfig, make_qlora, tmp_path):
    model = make_qlora(config)
    x = _input()
    expected = _logits(model, x)
    model.save_pretrained(tmp_path / "adapter")
    base = tiny_llama(0)
    quantize(base, config)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert isinstance(reloaded, PeftModel)
    assert torch.equal(_logits(reloaded, x), expected)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_merge_to_float_reproduces_the_adapter_model(config: QuantlabConfig, make_qlora):
    model = make_qlora(config)
    x = _input()
    expected = _logits(model, x)
    merged = merge_to_float(model)
    assert not quantized_layers(merged) and not hasattr(merged, "peft_config")
    assert (_logits(merged, x) - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_merge_to_quantized_is_the_float_merge_requantized(config: QuantlabConfig, make_qlora, tmp_path):
    """Merging into the quantized base equals merging in float, then quantizing with the same method."""
    x = _input()
    expected = quantize(merge_to_float(make_qlora(config)), config)
    model = make_qlora(config)
    adapter_logits = _logits(model, x)
    merged = merge_to_quantized(model)
    layers = quantized_layers(merged)
    assert sorted(layers) == sorted(quantized_layers(expected))
    assert all(m.config == config and not isinstance(m, QuantizedLoraLinear) for m in layers.values())
    merged_logits = _logits(merged, x)
    assert torch.equal(merged_logits, _logits(expected, x))
    assert not torch.equal(merged_logits, adapter_logits)  # re-quantization rounds the update
    merged.save_pretrained(tmp_path / "merged")


def test_merge_adds_the_adapter_before_requantizing(make_qlora):
    """Merging a large update must move the quantized weight by that update (up to quantization error)."""
    model = make_qlora(CONFIGS[0])
    layer = next(m for m in model.modules() if isinstance(m, QuantizedLoraLinear))
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(0.05)
    before = layer.get_base_layer().dequantize_weight()
    delta = layer.get_delta_weight("default")
    layer.merge()
    after = layer.get_base_layer().dequantize_weight()
    assert layer.merged
    assert (after - before - delta).norm() < 0.25 * delta.norm()
    layer.unmerge()
    assert not layer.merged


def test_dora_is_refused_with_a_clear_error():
    model = tiny_llama(0)
    quantize(model, CONFIGS[0])
    with pytest.raises(QuantlabError, match="does not support use_dora"):
        add_lora(model, r=4, use_dora=True)


def test_missing_target_module_names_the_real_ones():
    model = tiny_llama(0)
    quantize(model, CONFIGS[0])
    with pytest.raises(QuantlabError, match=r"'qkv' matches no Linear layer.*q_proj"):
        add_lora(model, target_modules=["q_proj", "qkv"])


_REGISTRATION_SCRIPT = """
import sys
{imports}
from peft import LoraConfig
from quantlab.nn import QuantizedLinear
print(LoraConfig(r=2)._custom_modules[QuantizedLinear].__name__)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "imports",
    [
        # quantlab first: importing its PEFT integration must not import PEFT, only arm the hook.
        "import quantlab.integrations.peft\nassert 'peft' not in sys.modules\nimport peft",
        "import peft\nimport quantlab.integrations.peft",
    ],
    ids=["quantlab-first", "peft-first"],
)
def test_registration_is_lazy_and_needs_no_call(imports: str):
    script = _REGISTRATION_SCRIPT.format(imports=imports)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("QuantizedLoraLinear")


def _bnb_4bit_model(tmp_path):
    pytest.importorskip("bitsandbytes")
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from quantlab.testing import tiny_model_dir

    directory = tiny_model_dir(tiny_llama(0), tmp_path / "float")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=config, dtype=torch.float32)
    torch.manual_seed(1)
    model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    return add_lora(model, r=4, alpha=8, dropout=0.0, init_lora_weights=False)


def test_bitsandbytes_4bit_qlora_trains_and_merges_to_float(tmp_path):
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    model = _bnb_4bit_model(tmp_path)
    assert sum(isinstance(m, LoraLinear4bit) for m in model.modules()) == 14
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = _input()
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    # Train mode: in eval mode on CPU bitsandbytes repacks its weights for a bf16 kernel, for good.
    with torch.no_grad():
        model.train()
        expected = model(input_ids=x).logits
    merged = merge_to_float(model)
    assert not any("4bit" in type(m).__name__ for m in merged.modules())
    assert (_logits(merged, x) - expected).abs().max() <= 1e-4
