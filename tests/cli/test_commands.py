"""`quantlab eval`, `methods` and `inspect` in process; a plugin method and `optimum-cli quantlab` in a fresh one."""

import json
import math
import shutil
import sys
import textwrap
from pathlib import Path

import pytest


def test_eval_reproduces_the_perplexity_quantize_reported(cli, quantized_llama) -> None:
    result = cli.run("eval", quantized_llama.output, *cli.tiny_eval, "--json")
    assert result.returncode == 0, result.stderr
    report = result.json()
    quantize_report = quantized_llama.result.json()
    # Same harness, same text prefix, same float32 reload: the very same number.
    assert report["perplexity"] == quantize_report["perplexity_after"]
    assert report["quantization"] == "quantlab_custom_bits"
    assert report["layers_quantized"] == 14 and report["layers_kept"] == 1
    assert report["bits_per_quantized_weight"] == pytest.approx(4.0)
    assert report["size_bytes"] == quantize_report["size_after_bytes"]
    assert report["tokens"] == 128


def test_eval_of_a_float_model_and_of_a_text_file(cli, llama_dir: Path, tmp_path: Path) -> None:
    from quantlab.assets.text import bundled_text

    (tmp_path / "text.txt").write_text(bundled_text()[:20_000], encoding="utf-8")
    result = cli.run("eval", llama_dir, "--text", tmp_path / "text.txt", "--seq-len", "32", "--windows", "3")
    assert result.returncode == 0, result.stderr
    assert "3 x 32 tokens of" in result.stdout and "text.txt" in result.stdout
    assert "none (float)" in result.stdout
    report = cli.run("eval", llama_dir, "--seq-len", "32", "--windows", "3", "--json").json()
    assert report["bits_per_quantized_weight"] is None
    assert report["bits_per_parameter"] == pytest.approx(32, rel=0.01)  # fp32 file (plus its header) / parameters
    assert report["perplexity"] != float(result.stdout.split("perplexity")[1].split()[0])  # another text


def test_methods_lists_every_method_with_options_and_defaults(cli) -> None:
    from quantlab import list_methods

    result = cli.run("methods", "--json")
    assert result.returncode == 0, result.stderr
    methods = {method["name"]: method for method in result.json()["methods"]}
    assert set(list_methods()) <= set(methods)
    nf4 = {option["flag"]: option for option in methods["nf4"]["options"]}
    assert nf4["--blocksize"]["default"] == 64
    assert nf4["--double-quant"]["type"] == "bool"
    assert methods["nf4"]["description"].startswith("NormalFloat-4")
    table = cli.run("methods").stdout
    assert "custom_bits  (quantlab)" in table and "--symmetric/--no-symmetric" in table


PLUGIN = '''
import dataclasses
from typing import Literal

from quantlab import register_method
from quantlab.methods.int8 import Int8Linear, Int8SymmetricConfig


@dataclasses.dataclass(repr=False)
class PluginConfig(Int8SymmetricConfig):
    """int8 from an outside package, with options the CLI has never seen."""

    method = "cli_test_plugin"
    flavour: Literal["plain", "spicy"] = "plain"
    strict: bool | None = None


class PluginLinear(Int8Linear):
    config_class = PluginConfig


def register():
    register_method(PluginConfig, PluginLinear, source="cli-test-plugin")
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A plugin distribution on PYTHONPATH that registers a method through the `quantlab.methods` entry point."""
    site = tmp_path_factory.mktemp("plugin-site")
    (site / "cli_test_plugin.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "cli_test_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cli-test-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[quantlab.methods]\ncli_test_plugin = cli_test_plugin:register\n")
    return {"PYTHONPATH": str(site)}


@pytest.mark.subprocess
def test_a_plugin_method_gets_listed_and_gets_its_flags(cli, plugin_path, llama_dir: Path, tmp_path: Path) -> None:
    """A fresh process, so the plugin's entry point is found as an installed one is."""
    quantlab = [sys.executable, "-m", "quantlab.cli.main"]
    listed = cli.command([*quantlab, "methods", "--json"], env=plugin_path)
    assert listed.returncode == 0, listed.stderr
    plugin = next(method for method in listed.json()["methods"] if method["name"] == "cli_test_plugin")
    assert plugin["source"] == "cli-test-plugin"
    flags = {option["flag"]: option for option in plugin["options"]}
    assert flags["--flavour"]["choices"] == ["plain", "spicy"]
    assert flags["--strict"]["accepts_none"]

    output = tmp_path / "plugin"
    quantize = ["quantize", llama_dir, "--method", "cli_test_plugin", "--flavour", "spicy", "--group-size", "32"]
    result = cli.command([*quantlab, *quantize, "--strict", "yes", "--output", output, "--json"], env=plugin_path)
    assert result.returncode == 0, result.stderr
    assert result.json()["layers_quantized"] == 14
    saved = json.loads((output / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "quantlab_cli_test_plugin"
    assert (saved["flavour"], saved["strict"], saved["group_size"]) == ("spicy", True, 32)

    wrong = cli.command([*quantlab, *quantize, "--flavour", "mild", "--output", tmp_path / "x"], env=plugin_path)
    cli.assert_user_error(wrong, "--flavour expects one of plain, spicy, got 'mild'")


def test_inspect_lists_layers_with_their_relative_error(cli, quantized_llama, llama_dir: Path) -> None:
    result = cli.run("inspect", quantized_llama.output, "--reference", llama_dir, "--json")
    assert result.returncode == 0, result.stderr
    layers = {layer["name"]: layer for layer in result.json()["layers"]}
    assert len(layers) == 15
    down = layers["model.layers.0.mlp.down_proj"]
    assert (down["method"], down["bits"], down["group_size"], down["shape"]) == ("custom_bits", 3, 32, [64, 192])
    # 192 x 64 codes at 3 bits (bit-packed) plus float16 scale and zero per 32 weights.
    assert down["stored_bytes"] == 64 * 192 * 3 // 8 + 64 * (192 // 32) * 2 * 2
    # Round-to-nearest at 3 bits on Gaussian-like weights: a relative error well inside these bounds.
    assert all(0.05 < layer["relative_error"] < 0.3 for layer in layers.values() if layer["method"] != "float")
    assert layers["lm_head"]["method"] == "float" and layers["lm_head"]["relative_error"] == 0.0


def test_inspect_compares_gpt2s_conv1d_layers_with_their_float_weights(cli, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from quantlab.methods.custom_bits import CustomBitsConfig
    from quantlab.testing.architectures import tiny_causal_lm

    tiny_causal_lm("gpt2").save_pretrained(tmp_path / "float")
    config = CustomBitsConfig(bits=4, group_size=32)
    AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config).save_pretrained(tmp_path / "q")
    result = cli.run("inspect", tmp_path / "q", "--reference", tmp_path / "float", "--json")
    assert result.returncode == 0, result.stderr
    layers = {layer["name"]: layer for layer in result.json()["layers"]}
    assert layers["transformer.h.0.attn.c_attn"]["shape"] == [192, 64]
    assert all(0.01 < layers[f"transformer.h.1.{name}"]["relative_error"] < 0.3 for name in ("attn.c_proj", "mlp.c_fc"))


def test_inspect_finds_the_reference_in_the_quantize_report(cli, quantized_llama, llama_dir: Path) -> None:
    result = cli.run("inspect", quantized_llama.output, "--reference", "--json")
    assert result.returncode == 0, result.stderr
    assert result.json()["reference"] == str(llama_dir.resolve())
    assert all(layer["relative_error"] is not None for layer in result.json()["layers"])


def test_inspect_reads_width_and_group_of_nf4_and_int8(cli, nf4_llama, llama_dir: Path, tmp_path: Path) -> None:
    int8 = tmp_path / "int8"
    assert cli.run("quantize", llama_dir, "--method", "int8", "--group-size", "channel", "-o", int8).returncode == 0
    for output, method, width, group in [(nf4_llama.output, "nf4", 4, 64), (int8, "int8", 8, None)]:
        result = cli.run("inspect", output)
        assert result.returncode == 0, result.stderr
        row = next(line for line in result.stdout.splitlines() if line.startswith("model.layers.0.mlp.up_proj"))
        assert row.split()[1:4] == [method, str(width), "channel" if group is None else str(group)]


@pytest.mark.subprocess
def test_optimum_cli_runs_the_same_quantize_and_reports_errors_the_same_way(
    cli, llama_dir: Path, tmp_path: Path
) -> None:
    optimum_cli = shutil.which("optimum-cli")
    if optimum_cli is None:
        pytest.skip("optimum is not installed")
    listed = cli.command([optimum_cli, "--help"])
    assert "quantlab" in listed.stdout
    wrong = cli.command([optimum_cli, "quantlab", "quantize", tmp_path / "nowhere", "--method", "nf4", "-o", "x"])
    cli.assert_user_error(wrong, "does not exist")
    output = tmp_path / "via-optimum"
    result = cli.command([optimum_cli, "quantlab", "quantize", llama_dir, "--method", "nf4", "-o", output, "--json"])
    assert result.returncode == 0, result.stderr
    assert result.json()["layers_quantized"] == 14
    assert math.isfinite(result.json()["bits_per_quantized_weight"])
    assert (output / "model.safetensors").is_file()
