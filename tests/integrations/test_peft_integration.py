"""PEFT and transformers see quantlab's quantized layers as they see bitsandbytes' (no quantlab call needed).

Each behaviour is checked against the float model it was quantized from: "all-linear" picks
the same layers, parameter counts and the trainable share are the same, the memory footprint
is what the layers store, and merging into the quantized base warns with the error it measured.
"""

import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from torch import nn

from quantlab.convert import quantize
from quantlab.errors import RequantizationWarning
from quantlab.integrations.peft.lora import QuantizedLoraLinear
from quantlab.nn import QuantizedLinear
from quantlab.registry import get_method, list_methods
from quantlab.replacement import quantized_layers
from quantlab.testing import tiny_llama
from quantlab.training import merge_to_float

CONFIGS = [get_method(name).config_class() for name in list_methods()]
IDS = [config.method for config in CONFIGS]
PROBE = torch.arange(48).reshape(2, 24) * 7 % 256


def _lora(**overrides) -> LoraConfig:
    options = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
    return LoraConfig(**{**options, **overrides})


def _quantized(config, keep_in_float: list[str] | None = None) -> nn.Module:
    """tiny_llama quantized with `config`; `keep_in_float` replaces the default skips (the output head)."""
    if keep_in_float is not None:
        config = type(config)(modules_to_not_convert=keep_in_float)
    return quantize(tiny_llama(0), config)


def _logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def _randomize_adapters(model: nn.Module, seed: int = 3) -> None:
    """A fresh LoRA has B = 0; give every adapter a non-zero update, as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_all_linear_targets_the_same_layers_as_on_the_float_model(config):
    float_targets = get_peft_model(tiny_llama(0), _lora()).peft_config["default"].target_modules
    model = get_peft_model(_quantized(config), _lora())
    assert model.peft_config["default"].target_modules == float_targets
    assert sum(isinstance(m, QuantizedLoraLinear) for m in model.modules()) == len(float_targets) == 14


def test_all_linear_leaves_out_a_quantized_output_head():
    model = _quantized(CONFIGS[0], keep_in_float=[])
    assert isinstance(model.lm_head, QuantizedLinear)  # the head is quantized too
    peft_model = get_peft_model(model, _lora())
    assert "lm_head" not in peft_model.peft_config["default"].target_modules
    assert type(peft_model.base_model.model.lm_head) is type(model.lm_head)


def test_all_linear_still_resolves_float_layers_and_a_second_adapter():
    """Beside quantized layers PEFT's own resolution is untouched; a second adapter wraps the same layers."""
    model = _quantized(CONFIGS[0], keep_in_float=["lm_head", "model.layers.1.mlp.down_proj"])
    peft_model = get_peft_model(model, _lora())
    targets = peft_model.peft_config["default"].target_modules
    assert "model.layers.1.mlp.down_proj" in targets and len(targets) == 14
    peft_model.add_adapter("second", _lora())
    assert peft_model.peft_config["second"].target_modules == targets


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_parameter_counts_equal_the_float_model(config, capsys):
    float_model = tiny_llama(0)
    model = _quantized(config)
    assert model.num_parameters() == float_model.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == float_model.num_parameters(exclude_embeddings=True)
    assert model.num_parameters(only_trainable=True) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    get_peft_model(float_model, _lora()).print_trainable_parameters()
    expected = capsys.readouterr().out
    peft_model = get_peft_model(model, _lora())
    peft_model.print_trainable_parameters()
    assert capsys.readouterr().out == expected
    assert peft_model.num_parameters() == get_peft_model(tiny_llama(0), _lora()).num_parameters()


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_memory_footprint_counts_the_stored_weights(config):
    float_model = tiny_llama(0)
    model = _quantized(config)
    layers = quantized_layers(model).values()
    stored = sum(layer.stored_bytes() for layer in layers)
    float_weights = sum(4 * layer.in_features * layer.out_features for layer in layers)
    assert model.get_memory_footprint() == float_model.get_memory_footprint() - float_weights + stored
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model.get_memory_footprint(return_buffers=False) == params + stored


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_prepare_model_for_kbit_training_turns_on_checkpointing_as_for_bitsandbytes(config):
    model = prepare_model_for_kbit_training(_quantized(config).to(torch.bfloat16))
    assert model.is_activation_checkpointing
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    for layer in quantized_layers(model).values():  # stored tensors keep their own dtypes
        assert all(
            t.dtype == spec[1]
            for t, spec in zip(
                layer.stored_tensors().values(),
                layer.storage_spec(layer.in_features, layer.out_features, layer.config).values(),
                strict=True,
            )
        )
    float_model = prepare_model_for_kbit_training(tiny_llama(0))
    assert not float_model.is_activation_checkpointing  # PEFT's behaviour for float models is unchanged
    off = prepare_model_for_kbit_training(_quantized(config), use_gradient_checkpointing=False)
    assert not off.is_activation_checkpointing


def test_checkpointed_qlora_gradients_match_without_checkpointing():
    """Reentrant checkpointing (PEFT's default) reaches the adapters through the frozen quantized layers."""
    grads = []
    for checkpointing in (True, False):
        torch.manual_seed(1)
        model = prepare_model_for_kbit_training(_quantized(CONFIGS[0]), use_gradient_checkpointing=checkpointing)
        model = get_peft_model(model, _lora(init_lora_weights=False))
        model.train()
        model(input_ids=PROBE, labels=PROBE).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 28
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], msg=name)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_merge_and_unload_warns_with_the_measured_rounding_error(config):
    peft_model = get_peft_model(_quantized(config), _lora())
    _randomize_adapters(peft_model)
    reference = get_peft_model(_quantized(config), _lora())
    _randomize_adapters(reference)
    exact = merge_to_float(reference)
    adapter_logits = _logits(peft_model)
    with pytest.warns(RequantizationWarning, match=r"merge_to_float") as caught:
        merged = peft_model.merge_and_unload()
    assert len([w for w in caught if w.category is RequantizationWarning]) == 1
    message = str(next(w.message for w in caught if w.category is RequantizationWarning))
    reported = float(re.search(r"relative weight error of ([0-9.e+-]+)%", message).group(1)) / 100
    error = weight = 0.0
    for name, layer in quantized_layers(merged).items():
        expected = exact.get_submodule(name).weight.detach()
        error += float((layer.dequantize_weight() - expected).square().sum())
        weight += float(expected.square().sum())
    assert reported == pytest.approx((error / weight) ** 0.5, rel=5e-3)
    assert f"14 merged layer(s) with {config.method}" in message
    assert not torch.equal(_logits(merged), adapter_logits)


def test_merge_and_unload_requantizes_a_calibrated_model_with_the_data_free_solver():
    """A GPTQ layer keeps `solver="gptq"` in its config; merging has no calibration data, so it rounds the sum
    with the data-free solver on the same format instead of failing."""
    config = get_method("custom_bits").config_class(bits=4, group_size=32, solver="gptq", calibration_samples=4)
    model = quantize(tiny_llama(0), config, calibration=torch.randint(0, 256, (4, 32)), progress=False)
    peft_model = get_peft_model(model, _lora())
    _randomize_adapters(peft_model)
    adapter_logits = _logits(peft_model)
    with pytest.warns(RequantizationWarning):
        merged = peft_model.merge_and_unload()
    assert len(quantized_layers(merged)) == 14
    assert ((_logits(merged) - adapter_logits).norm() / adapter_logits.norm()) < 0.1


def test_merge_adapter_warns_once_and_a_single_layer_merge_warns_for_itself():
    peft_model = get_peft_model(_quantized(CONFIGS[0]), _lora())
    _randomize_adapters(peft_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model.merge_adapter()
    assert [str(w.message).split(":")[0] for w in caught if w.category is RequantizationWarning] == [
        "merge_adapter() re-quantized 14 merged layer(s) with " + CONFIGS[0].method
    ]
    peft_model.unmerge_adapter()
    layer = next(m for m in peft_model.modules() if isinstance(m, QuantizedLoraLinear))
    with pytest.warns(RequantizationWarning, match=r"merge\(\) re-quantized 1 merged layer"):
        layer.merge()


def test_merging_a_float_model_does_not_warn():
    peft_model = get_peft_model(tiny_llama(0), _lora())
    _randomize_adapters(peft_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RequantizationWarning)
        peft_model.merge_and_unload()


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_unload_gives_back_the_quantized_base_unchanged(config):
    base = _quantized(config)
    expected = _logits(base)
    peft_model = get_peft_model(base, _lora())
    _randomize_adapters(peft_model)
    assert not torch.equal(_logits(peft_model), expected)
    unloaded = peft_model.unload()
    assert not any(isinstance(m, QuantizedLoraLinear) for m in unloaded.modules())
    assert len(quantized_layers(unloaded)) == 14
    assert torch.equal(_logits(unloaded), expected)


@pytest.mark.subprocess
def test_importing_transformers_does_not_import_quantlab():
    """The start-up hook stays light: quantlab loads with transformers' model code, not with `import transformers`."""
    script = "import sys, transformers; print(sorted(m for m in sys.modules if m.startswith(('quantlab', 'peft'))))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


_ADAPTED = [
    "peft.tuners.tuners_utils._maybe_include_all_linear_layers",
    "peft.prepare_model_for_kbit_training",
    "peft.utils.prepare_model_for_kbit_training",
    "peft.PeftModel.get_nb_trainable_parameters",
    "peft.tuners.lora.LoraModel.merge_and_unload",
    "transformers.PreTrainedModel.num_parameters",
]


@pytest.mark.subprocess
@pytest.mark.parametrize("order", ["import peft\nimport quantlab", "import quantlab\nimport peft"])
def test_adaptations_apply_whichever_is_imported_first(order):
    """Without the start-up hook: PEFT loaded before quantlab is adapted at once, after it as it loads."""
    lookups = "\n".join(
        f"print(hasattr(operator.attrgetter({path.partition('.')[2]!r})({path.partition('.')[0]}), "
        f"'__quantlab_original__'))"
        for path in _ADAPTED
    )
    script = f"import operator\n{order}\nimport transformers\n{lookups}"
    env = {**os.environ, "QUANTLAB_AUTOLOAD": "0"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True"] * len(_ADAPTED)


def test_quantlab_nf4_and_bitsandbytes_nf4_look_the_same_to_peft(tmp_path, capsys):
    """The recipe's observable figures for a quantlab NF4 model equal those for a bitsandbytes NF4 model."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import quantlab

    tiny_llama(0).save_pretrained(tmp_path / "float")
    configs = {
        "bitsandbytes": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
        ),
        "quantlab": quantlab.NF4Config(),
    }
    seen = {}
    for name, config in configs.items():
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path / "float", quantization_config=config, dtype=torch.float32
        )
        count = model.num_parameters()
        model = get_peft_model(prepare_model_for_kbit_training(model), _lora())
        model.print_trainable_parameters()
        seen[name] = (
            count,
            model.is_activation_checkpointing,
            sorted(model.peft_config["default"].target_modules),
            capsys.readouterr().out,
        )
    assert seen["quantlab"] == seen["bitsandbytes"]
    assert seen["quantlab"][1] and seen["quantlab"][0] == tiny_llama(0).num_parameters()


QALORA_CONFIG = get_method("custom_bits").config_class(bits=4, group_size=32, symmetric=False, scale_dtype="float32")


def test_qa_lora_merges_into_the_zero_points_keeping_codes_and_scales():
    base = _quantized(QALORA_CONFIG)
    stored = {name: layer.stored_tensors() for name, layer in quantized_layers(base).items()}
    peft_model = get_peft_model(base, _lora(use_qalora=True, qalora_group_size=64))
    _randomize_adapters(peft_model)
    adapter_logits = _logits(peft_model)
    assert not torch.equal(adapter_logits, _logits(_quantized(QALORA_CONFIG)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RequantizationWarning)
        merged = peft_model.merge_and_unload()
    layers = quantized_layers(merged)
    assert layers.keys() == stored.keys()
    for name, layer in layers.items():
        before = stored[name]
        assert torch.equal(layer.weight, before["weight"]) and torch.equal(layer.weight_scale, before["weight_scale"])
        assert not torch.equal(layer.weight_zero, before["weight_zero"])
    torch.testing.assert_close(_logits(merged), adapter_logits, rtol=0, atol=1e-4)


def test_qa_lora_unmerges_back_to_the_zero_points_it_started_from():
    base = _quantized(QALORA_CONFIG)
    zeros = {name: layer.weight_zero.clone() for name, layer in quantized_layers(base).items()}
    peft_model = get_peft_model(base, _lora(use_qalora=True, qalora_group_size=32))
    _randomize_adapters(peft_model)
    adapter_logits = _logits(peft_model)
    peft_model.merge_adapter()
    torch.testing.assert_close(_logits(peft_model), adapter_logits, rtol=0, atol=1e-4)
    peft_model.unmerge_adapter()
    for name, layer in quantized_layers(peft_model).items():
        original = zeros[name.removeprefix("base_model.model.").removesuffix(".base_layer")]
        torch.testing.assert_close(layer.weight_zero, original, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("config", "group", "message"),
    [
        (get_method("custom_bits").config_class(bits=4, group_size=32, symmetric=True), 32, "stores none"),
        (QALORA_CONFIG, 16, "multiple of its quantization group"),
    ],
)
def test_qa_lora_refuses_layers_it_cannot_merge_into(config, group, message):
    from quantlab.errors import QuantlabError

    with pytest.raises(QuantlabError, match=message):
        get_peft_model(_quantized(config), _lora(use_qalora=True, qalora_group_size=group))
