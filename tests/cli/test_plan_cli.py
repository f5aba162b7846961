"""`quantlab quantize --plan`: the plan printed before any work, nothing written; a mixture of experts end to end."""

import json
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from quantlab.testing import byte_tokenizer


def test_the_plan_is_printed_and_nothing_is_written(cli, llama_dir: Path, tmp_path: Path) -> None:
    before = sorted(path.name for path in llama_dir.iterdir())
    result = cli.run("quantize", llama_dir, "--method", "custom_bits", "--bits", "3", "--group-size", "32",
                     "--solver", "gptq", "--plan")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "method custom_bits, solver gptq" in result.stdout
    assert "model.layers.{0-1}.mlp.down_proj  64x192  affine  3-bit  g32  4.000 b/w  gptq" in result.stdout
    assert "calibration: 128 windows of 256 tokens of the bundled WikiText-2" in result.stdout
    assert sorted(path.name for path in llama_dir.iterdir()) == before and not list(tmp_path.iterdir())
    as_json = cli.run("quantize", llama_dir, "--method", "nf4", "--plan", "--json").json()
    assert as_json["plan"]["layers"]["model.layers.0.self_attn.q_proj"]["format"] == "nf4"


def test_quantize_needs_an_output_unless_it_plans(cli, llama_dir: Path) -> None:
    result = cli.run("quantize", llama_dir, "--method", "nf4")
    cli.assert_user_error(result, "required: --output/-o (unless --plan")


def test_a_mixture_of_experts_is_quantized_whole_and_said_so(cli, tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, max_position_embeddings=128,
    )  # fmt: skip
    MixtralForCausalLM(config).save_pretrained(tmp_path / "moe")
    byte_tokenizer().save_pretrained(tmp_path / "moe")
    result = cli.run("quantize", tmp_path / "moe", "--method", "custom_bits", "--bits", "4", "--group-size", "32",
                     "--output", tmp_path / "out", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert report["layers_quantized"] == 12 and report["left_in_float"] == {}
    assert report["plan"]["quantized_share"] > 0.99  # all but the routers
    assert report["size_after_bytes"] < 0.4 * report["size_before_bytes"]
    saved = json.loads((tmp_path / "out" / "quantlab_report.json").read_text())
    assert saved["plan"]["layers"]["model.layers.1.mlp.experts.down_proj"]["experts"] == 4
