"""AWQ: scales folded into the block keep the float function, and lower the rounding error."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.calibration.awq import _fold, scale_block, scale_groups
from quantlab.calibration.blocks import find_blocks, first_block_inputs, run_block
from quantlab.calibration.sequential import selected_linears
from quantlab.testing.models import tiny_bert, tiny_llama, tiny_llama_checkpoint

CALIBRATION = torch.randint(0, 256, (32, 64), generator=torch.Generator().manual_seed(0))
UNSEEN = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))


def _with_outlier_channels(model):
    """A few input channels 8x larger, as trained transformers have: something for AWQ to find."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:4] *= 8
            layer.post_attention_layernorm.weight[:4] *= 8
    return model


def _first_block(model):
    prefix, blocks = find_blocks(model)
    batches = first_block_inputs(model, blocks[0], CALIBRATION[:8], batch_size=4)
    return blocks[0], batches, selected_linears(blocks[0], f"{prefix}.0", lambda name: True)


@pytest.mark.parametrize("make", [tiny_llama, tiny_bert], ids=["llama", "bert"])
def test_folding_keeps_the_float_block(make):
    model = make()
    block, batches, names = _first_block(model)
    expected = run_block(block, batches[0])
    with torch.no_grad():
        for group in scale_groups(block, names):
            in_features = block.get_submodule(group.layers[0]).in_features
            _fold(block, group, torch.rand(in_features) * 3 + 0.5)
    torch.testing.assert_close(run_block(block, batches[0]), expected, rtol=1e-4, atol=1e-5)


def test_groups_follow_the_architecture():
    llama_block, _, names = _first_block(tiny_llama())
    groups = {group.previous: group.layers for group in scale_groups(llama_block, names)}
    assert groups["input_layernorm"] == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert "self_attn.v_proj" not in groups  # grouped-query attention: v_proj's outputs are not o_proj's inputs
    assert groups["mlp.up_proj"] == ("mlp.down_proj",)
    bert_block, _, bert_names = _first_block(tiny_bert())
    # BERT's LayerNorms feed residual connections too: only value -> output.dense folds.
    assert {g.previous for g in scale_groups(bert_block, bert_names)} == {"attention.self.value"}


def test_only_layers_being_quantized_are_scaled():
    block, _, names = _first_block(tiny_llama())
    kept = {name: full for name, full in names.items() if not name.startswith("mlp.")}
    assert {g.previous for g in scale_groups(block, kept)} == {"input_layernorm"}


def _logit_error(awq: bool, solver: str) -> float:
    reference = _with_outlier_channels(tiny_llama())
    model = _with_outlier_channels(tiny_llama())
    config = quantlab.CustomBitsConfig(bits=3, group_size=32, solver=solver, awq=awq)
    quantlab.quantize(model, config, calibration=CALIBRATION, progress=False)
    with torch.no_grad():
        return (model(UNSEEN).logits - reference(UNSEEN).logits).square().mean().item()


def test_awq_lowers_the_rounding_error_on_unseen_tokens():
    assert _logit_error(awq=True, solver="rtn") < 0.8 * _logit_error(awq=False, solver="rtn")


def test_awq_combines_with_gptq():
    """On this tiny model AWQ + GPTQ is within 1.5x of GPTQ alone and far better than rounding."""
    combined = _logit_error(awq=True, solver="gptq")
    assert combined < 1.5 * _logit_error(awq=False, solver="gptq")
    assert combined < 0.5 * _logit_error(awq=False, solver="rtn")


def test_scale_block_picks_no_scaling_when_rounding_is_exact():
    block, batches, names = _first_block(tiny_llama())
    assert set(scale_block(block, batches, names, lambda weight, name: weight).values()) == {0.0}


def test_bert_blocks_take_awq():
    model = tiny_bert()
    config = quantlab.Int8SymmetricConfig(solver="gptq", awq=True)
    quantlab.quantize(model, config, calibration=CALIBRATION[:8, :32], progress=False)
    assert type(model.encoder.layer[0].intermediate.dense).__name__ == "Int8Linear"


class _Unknown(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


def test_an_unknown_block_warns_once_and_is_left_alone():
    with pytest.warns(UserWarning, match="AWQ scaling does not apply to _Unknown blocks"):
        assert scale_groups(_Unknown(), {"proj": "proj"}) == []


def test_an_awq_checkpoint_reloads_bit_identically(tmp_path):
    source = tiny_llama_checkpoint(tmp_path / "float", model=_with_outlier_channels(tiny_llama()))
    config = quantlab.CustomBitsConfig(bits=4, group_size=32, awq=True, calibration_samples=8, calibration_seq_len=64)
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config)
    model.save_pretrained(tmp_path / "quantized")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized")
    with torch.no_grad():
        assert torch.equal(model(UNSEEN).logits, reloaded(UNSEEN).logits)
