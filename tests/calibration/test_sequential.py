"""Block-by-block calibration on tiny models: solvers lower the output error on unseen tokens,
checkpoints reload bit-identically, and every selected layer is quantized."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.calibration import collect_input_stats
from quantlab.calibration.blocks import find_blocks, first_block_inputs
from quantlab.errors import QuantizationError
from quantlab.replacement import quantized_layers
from quantlab.testing.models import tiny_bert, tiny_llama, tiny_llama_checkpoint

CALIBRATION = torch.randint(0, 256, (32, 64), generator=torch.Generator().manual_seed(0))
UNSEEN = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))


def _logit_error(config: quantlab.QuantlabConfig) -> float:
    reference = tiny_llama()
    model = tiny_llama()
    quantlab.quantize(model, config, calibration=CALIBRATION, progress=False)
    with torch.no_grad():
        return (model(UNSEEN).logits - reference(UNSEEN).logits).square().mean().item()


@pytest.mark.parametrize(
    "make",
    [
        lambda solver: quantlab.CustomBitsConfig(bits=3, group_size=32, solver=solver),
        lambda solver: quantlab.NF4Config(blocksize=32, solver=solver),
        lambda solver: quantlab.Int8SymmetricConfig(solver=solver),
    ],
    ids=["custom_bits-3", "nf4", "int8"],
)
def test_gptq_beats_round_to_nearest_on_unseen_tokens(make):
    assert _logit_error(make("gptq")) < 0.9 * _logit_error(make("rtn"))


def test_every_selected_layer_is_quantized_and_the_head_kept():
    model = tiny_llama()
    quantlab.quantize(model, quantlab.CustomBitsConfig(solver="gptq"), calibration=CALIBRATION, progress=False)
    assert len(quantized_layers(model)) == 2 * 7
    assert type(model.lm_head) is nn.Linear


def test_layers_reading_one_input_share_their_statistics():
    model = tiny_llama()
    _, blocks = find_blocks(model)
    batches = first_block_inputs(model, blocks[0], CALIBRATION[:8], batch_size=4)
    names = {name: name for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj")}
    stats = collect_input_stats(blocks[0], names, batches)
    assert stats["self_attn.q_proj"] is stats["self_attn.k_proj"]
    assert stats["mlp.gate_proj"] is stats["mlp.up_proj"]
    assert stats["self_attn.q_proj"] is not stats["mlp.gate_proj"]
    assert stats["mlp.gate_proj"].count == 8 * 64


def test_bert_blocks_calibrate():
    model = tiny_bert()
    quantlab.quantize(
        model, quantlab.Int8SymmetricConfig(solver="gptq"), calibration=CALIBRATION[:8, :32], progress=False
    )
    assert "encoder.layer.0.attention.self.query" in quantized_layers(model)


def test_calibrated_solver_needs_data():
    with pytest.raises(QuantizationError, match="needs calibration"):
        quantlab.quantize(nn.Linear(64, 8), quantlab.CustomBitsConfig(solver="gptq"))
    with pytest.raises(QuantizationError, match="tokenizer"):
        quantlab.quantize(tiny_llama(), quantlab.CustomBitsConfig(solver="gptq"), progress=False)


def test_from_pretrained_calibrates_then_reloads_bit_identically(tmp_path):
    """Act order (the default) permutes columns while solving; the checkpoint has the normal layout."""
    source = tiny_llama_checkpoint(tmp_path / "float")
    config = quantlab.CustomBitsConfig(
        bits=4, group_size=32, solver="gptq", calibration_samples=8, calibration_seq_len=64
    )
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config)
    assert len(quantized_layers(model)) == 14
    model.save_pretrained(tmp_path / "quantized")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized")
    with torch.no_grad():
        assert torch.equal(model(UNSEEN).logits, reloaded(UNSEEN).logits)
    assert reloaded.config.quantization_config.solver == "gptq"


def test_from_pretrained_without_a_tokenizer_says_so(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(Exception, match="tokenizer"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantlab.NF4Config(solver="gptq"))
