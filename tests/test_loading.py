"""Loading behaviours beyond the per-method contract."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.replacement import quantized_layers
from quantlab.testing import tiny_llama


def test_nan_weight_while_loading_raises_one_clear_error(tmp_path):
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 4] = float("inf")
    model.save_pretrained(tmp_path)
    with pytest.raises(quantlab.QuantizationError, match=r"model\.layers\.1\.mlp\.up_proj: weight has 1 NaN/Inf"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantlab.NF4Config())


def test_modules_to_not_convert_keeps_layers_in_float(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    # transformers' matching: a name prefix up to a module boundary, a regex, or a suffix.
    config = quantlab.Int8SymmetricConfig(modules_to_not_convert=["lm_head", "model.layers.1", "down_proj"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    names = quantized_layers(model)
    assert len(names) == 6
    assert all(name.startswith("model.layers.0.") and "down_proj" not in name for name in names)
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear


def test_tied_embeddings_stay_float(tmp_path):
    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantlab.NF4Config())
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_quantize_selected_modules_only():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    quantlab.quantize(model, quantlab.Int8SymmetricConfig(), modules=["2"])
    assert list(quantized_layers(model)) == ["2"]


def test_quantize_a_lone_linear_returns_the_quantized_layer():
    layer = quantlab.quantize(nn.Linear(64, 32), quantlab.Int8SymmetricConfig())
    assert isinstance(layer, quantlab.QuantizedLinear)


def test_quantize_reports_models_without_linear_layers():
    with pytest.raises(quantlab.QuantizationError, match=r"no nn\.Linear layer"):
        quantlab.quantize(nn.Sequential(nn.Conv1d(2, 2, 3)), quantlab.NF4Config())


def test_state_dict_of_float_model_is_refused_by_quantized_layers():
    model = nn.Sequential(nn.Linear(64, 64))
    float_state = {k: v.clone() for k, v in model.state_dict().items()}
    quantlab.quantize(model, quantlab.NF4Config())
    with pytest.raises(quantlab.QuantizationError, match="float weight for a quantized module"):
        model.load_state_dict(float_state)


def test_model_dequantize_gives_float_linears(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantlab.CustomBitsConfig(bits=3))
    tokens = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        expected = model(tokens).logits
    model = model.dequantize()
    assert not quantized_layers(model)
    assert not hasattr(model.config, "quantization_config")
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.subprocess
def test_without_quantlab_a_checkpoint_refuses_to_load(tmp_path):
    """With quantlab absent (autoload off, import blocked) loading stops instead of running codes as floats."""
    tiny_llama().save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=quantlab.Int8SymmetricConfig())
    model.save_pretrained(tmp_path / "quantized")
    script = textwrap.dedent(
        f"""
        import sys
        class BlockQuantlab:
            def find_spec(self, name, path=None, target=None):
                if name == "quantlab" or name.startswith("quantlab."):
                    raise ModuleNotFoundError("No module named 'quantlab'")
        sys.meta_path.insert(0, BlockQuantlab())
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(tmp_path / "quantized")!r})
        except RuntimeError as error:
            sys.exit(0 if "mismatch" in str(error) or "ignore_mismatched_sizes" in str(error) else 4)
        sys.exit(3)
        """
    )
    env = {"QUANTLAB_AUTOLOAD": "0", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "quantlab_int8" in result.stderr, "the warning names the missing method"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux")
def test_quantize_on_load_gives_back_the_checkpoint_pages_it_read(tmp_path):
    """Each float weight's pages of the memory-mapped checkpoint are returned once it is quantized,
    so loading never holds the whole float checkpoint resident (and the model stays correct)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    checkpoint = tmp_path / "model.safetensors"
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantlab.NF4Config())
    resident = _resident_bytes_of_mapping(checkpoint)
    assert resident < 0.25 * checkpoint.stat().st_size, (resident, checkpoint.stat().st_size)
    reference = quantlab.quantize(LlamaForCausalLM.from_pretrained(tmp_path), quantlab.NF4Config())
    tokens = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)


def _resident_bytes_of_mapping(path) -> int:
    resident, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = line.endswith(str(path))
        elif inside and fields[0] == "Rss:":
            resident += int(fields[1]) * 1024
    return resident
