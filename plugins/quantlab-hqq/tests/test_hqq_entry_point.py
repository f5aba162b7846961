"""The installed plugin is found through its entry point, in processes that never import it."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.registry import ENTRY_POINT_GROUP, get_method
from quantlab.testing import tiny_llama
from quantlab_hqq import HqqConfig, HqqLinear


def run_fresh(script: str, cwd) -> dict:
    """Run `script` in a new interpreter; it prints one JSON object as its last line."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    (entry_point,) = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == "hqq"]
    assert entry_point.value == "quantlab_hqq:register"


def test_registered_with_its_source():
    method = get_method("hqq")
    assert method.config_class is HqqConfig and method.module_class is HqqLinear
    assert method.source == "quantlab-hqq"
    assert "hqq" in quantlab.list_methods()


@pytest.fixture(scope="module")
def quantized_in_a_fresh_process(tmp_path_factory) -> dict:
    """A process that imports quantlab but not the plugin lists the methods, then quantizes the tiny
    Llama on load with a config built from the registry (as the CLI does) and saves it."""
    folder = tmp_path_factory.mktemp("fresh")
    tiny_llama().save_pretrained(folder / "float")
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, folder / "tokens.pt")
    report = run_fresh(
        f"""
        import json, torch, quantlab
        from transformers import AutoModelForCausalLM
        method = quantlab.get_method("hqq")
        listed = {{"methods": quantlab.list_methods(), "source": method.source, "config": method.config_class.__name__}}
        config = method.config_class.from_options({{"bits": 3, "group_size": 32}})
        model = AutoModelForCausalLM.from_pretrained({str(folder / "float")!r}, quantization_config=config)
        model.save_pretrained({str(folder / "hqq")!r})
        with torch.no_grad():
            logits = model(torch.load({str(folder / "tokens.pt")!r}, weights_only=True)).logits
        torch.save(logits, {str(folder / "logits.pt")!r})
        print(json.dumps({{**listed, "layer": type(model.model.layers[0].mlp.down_proj).__name__}}))
        """,
        folder,
    )
    return {**report, "folder": folder}


@pytest.mark.subprocess
def test_the_plugins_config_quantizes_on_load_before_any_method_is_looked_up(tmp_path):
    """Importing the plugin's config class registers nothing; loading a model with it must still
    find the plugin (transformers looks the quantizer up by name)."""
    tiny_llama().save_pretrained(tmp_path / "float")
    report = run_fresh(
        f"""
        import json
        from transformers import AutoModelForCausalLM
        from quantlab_hqq import HqqConfig
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "float")!r}, quantization_config=HqqConfig(bits=4))
        print(json.dumps({{"layer": type(model.model.layers[0].mlp.down_proj).__name__}}))
        """,
        tmp_path,
    )
    assert report["layer"] == "HqqLinear"


@pytest.mark.subprocess
def test_listed_in_a_fresh_process_without_importing_the_plugin(quantized_in_a_fresh_process):
    found = quantized_in_a_fresh_process
    assert "hqq" in found["methods"]
    assert found["source"] == "quantlab-hqq" and found["config"] == "HqqConfig"


@pytest.mark.subprocess
def test_from_pretrained_by_method_name_in_a_fresh_process(quantized_in_a_fresh_process):
    """A config built from the registry quantizes on load; the saved folder then reloads in another
    process that imports neither quantlab nor the plugin."""
    assert quantized_in_a_fresh_process["layer"] == "HqqLinear"
    folder = quantized_in_a_fresh_process["folder"]
    reloaded = run_fresh(
        f"""
        import json, sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder / "hqq")!r})
        with torch.no_grad():
            logits = model(torch.load({str(folder / "tokens.pt")!r}, weights_only=True)).logits
        same = torch.equal(logits, torch.load({str(folder / "logits.pt")!r}, weights_only=True))
        print(json.dumps({{"same": same, "layer": type(model.model.layers[0].mlp.down_proj).__name__}}))
        """,
        folder,
    )
    assert reloaded == {"same": True, "layer": "HqqLinear"}


def test_same_logits_as_quantizing_in_process(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "float")
    config = HqqConfig(bits=4, group_size=32)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config)
    converted = quantlab.quantize(tiny_llama(), config)
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, converted(tokens).logits)


def test_command_line_takes_the_method_and_its_options(tmp_path):
    from quantlab.cli.main import main

    tiny_llama().save_pretrained(tmp_path / "float")
    argv = [str(tmp_path / "float"), "--method", "hqq", "--bits", "3", "--group-size", "32", "--iterations", "5"]
    assert main(["quantize", *argv, "--optimize-scale", "--output", str(tmp_path / "out"), "--quiet"]) == 0
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "quantlab_hqq"
    assert (saved["bits"], saved["group_size"], saved["iterations"], saved["optimize_scale"]) == (3, 32, 5, True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model.model.layers[1].self_attn.o_proj) is HqqLinear
