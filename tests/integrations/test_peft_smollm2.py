"""PEFT on the real SmolLM2-135M: a quantized model counts its quantized weights as parameters.

Slow: SmolLM2 is quantized while loading, once per method.
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.assets.models import smollm2_dir

pytestmark = pytest.mark.slow

SMOLLM2_PARAMETERS = 134_515_008


def _trainable_line(model, capsys) -> str:
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    get_peft_model(model, lora).print_trainable_parameters()
    return capsys.readouterr().out


def _load(**options):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32, local_files_only=True, **options)


@pytest.mark.parametrize("config", [quantlab.NF4Config(), quantlab.Int8SymmetricConfig()], ids=["nf4", "int8"])
def test_quantized_smollm2_reports_the_float_figures(config, capsys):
    float_model = _load()
    assert float_model.num_parameters() == SMOLLM2_PARAMETERS
    float_line = _trainable_line(float_model, capsys)
    del float_model
    model = _load(quantization_config=config)
    assert model.num_parameters() == SMOLLM2_PARAMETERS
    assert model.get_memory_footprint() < 0.6 * SMOLLM2_PARAMETERS * 4
    assert _trainable_line(model, capsys) == float_line
