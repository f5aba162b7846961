"""AWQ across the architecture matrix: the folds keep every block's float function, mixtures of experts are
scaled (each expert scored on its own routed tokens), and Gemma's `1 + weight` norms fold as such."""

import warnings

import pytest
import torch

import quantlab
from quantlab.calibration.awq import _fold, scale_block, scale_groups
from quantlab.calibration.blocks import BlockInputs, find_blocks, first_block_inputs, run_block
from quantlab.calibration.experts import MIN_EXPERT_TOKENS, unfuse_experts
from quantlab.calibration.sequential import as_linears, selected_linears
from quantlab.plan import build_plan
from quantlab.testing.architectures import ARCHITECTURES, tiny_causal_lm

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
CALIBRATION = torch.randint(0, 256, (32, 64), generator=torch.Generator().manual_seed(0))
UNSEEN = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
# Blocks AWQ has no fold for (post-norm blocks, parallel attention and MLP, GELU between the MLP's projections):
UNSCALED = {"olmo2", "opt", "gpt_neox", "falcon", "gpt2"}


def _calibration_blocks(model, tokens=TOKENS):
    """Each block as calibration sees it (experts unfused, Linear kinds as nn.Linear), with its planned layers."""
    plan = build_plan(model, quantlab.CustomBitsConfig(bits=4, group_size=32))
    prefix, blocks = find_blocks(model)
    batches = first_block_inputs(model, blocks[0], tokens, batch_size=tokens.shape[0])
    for index, block in enumerate(blocks):
        unfuse_experts(block, f"{prefix}.{index}", plan)
        names = selected_linears(block, f"{prefix}.{index}", plan.selects)
        as_linears(block, names)
        yield block, batches, names
        batches = [BlockInputs(run_block(block, batch), batch.kwargs) for batch in batches]


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_folding_random_scales_keeps_every_block(model_type):
    generator = torch.Generator().manual_seed(1)
    scaled = 0
    for block, batches, names in _calibration_blocks(tiny_causal_lm(model_type)):
        expected = run_block(block, batches[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the blocks AWQ does not apply to say so once
            groups = scale_groups(block, names)
        with torch.no_grad():
            for group in groups:
                in_features = block.get_submodule(group.layers[0]).in_features
                _fold(block, group, torch.rand(in_features, generator=generator) * 3 + 0.5)
        torch.testing.assert_close(run_block(block, batches[0]), expected, rtol=1e-4, atol=1e-5)
        scaled += len(groups)
    assert (scaled == 0) == (model_type in UNSCALED)


def test_a_mixture_scales_its_experts_behind_the_router():
    block, _, names = next(_calibration_blocks(tiny_causal_lm("qwen2_moe")))
    groups = {group.previous: group for group in scale_groups(block, names)}
    norm = groups["post_attention_layernorm"]
    assert norm.source == "mlp.gate" and norm.followers == ("mlp.gate",)  # the float router: scaled, not scored
    assert {f"mlp.experts.gate_up_proj.{e}" for e in range(8)} | {"mlp.shared_expert_gate"} <= set(norm.layers)
    up_half = groups["mlp.experts.gate_up_proj.3"]
    assert up_half.layers == ("mlp.experts.down_proj.3",) and up_half.rows == (32, 64)
    assert groups["mlp.shared_expert.up_proj"].layers == ("mlp.shared_expert.down_proj",)


def test_gemma_scales_the_norm_before_its_mlp():
    block, _, names = next(_calibration_blocks(tiny_causal_lm("gemma2")))
    previous = {group.previous for group in scale_groups(block, names)}
    assert "pre_feedforward_layernorm" in previous and "post_attention_layernorm" not in previous


def test_an_expert_few_tokens_reach_is_left_unscaled():
    model = tiny_causal_lm("mixtral")  # 4 experts, 2 per token: 32 tokens route 64 pairs
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(2))
    block, batches, names = next(_calibration_blocks(model, tokens))
    routed = torch.zeros(4, dtype=torch.long)

    def count(module, args, output) -> None:
        routed.add_(torch.bincount(output[-1].flatten(), minlength=4))

    handle = block.mlp.gate.register_forward_hook(count)
    run_block(block, batches[0])
    handle.remove()
    chosen = scale_block(block, batches, names, lambda weight, name: (weight * 4).round() / 4)
    for expert in range(4):
        if routed[expert] < MIN_EXPERT_TOKENS:
            assert chosen[f"mlp.experts.gate_up_proj.{expert}"] == 0.0
    assert set(routed.tolist()) == {13, 21, 18, 12}  # both kinds of expert (the seed's routing)
    assert set(chosen) >= {f"mlp.experts.gate_up_proj.{expert}" for expert in range(4)}


def _with_outlier_channels(model):
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("layernorm.weight"):
                parameter[:4] *= 8
    return model


def _logit_error(model_type: str, awq: bool) -> float:
    reference = _with_outlier_channels(tiny_causal_lm(model_type))
    model = _with_outlier_channels(tiny_causal_lm(model_type))
    config = quantlab.CustomBitsConfig(bits=3, group_size=32, awq=awq)
    quantlab.quantize(model, config, calibration=CALIBRATION, progress=False)
    with torch.no_grad():
        return (model(UNSEEN).logits - reference(UNSEEN).logits).square().mean().item()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gemma2"])
def test_awq_lowers_the_rounding_error(model_type):
    assert _logit_error(model_type, awq=True) < 0.85 * _logit_error(model_type, awq=False)
