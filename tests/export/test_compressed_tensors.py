"""compressed-tensors export: quantlab's codes as a checkpoint transformers loads with the compressed-tensors
package, in a process that never imports quantlab, with quantlab's logits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import quantlab
from quantlab.export import to_compressed_tensors
from quantlab.export.compressed_tensors import CompressedTensorsExportError
from quantlab.formats import grouping
from quantlab.interop import compressed_tensors as ct
from quantlab.testing import tiny_llama
from quantlab.testing.models import tiny_qwen2

pytest.importorskip("compressed_tensors")

IDS = torch.arange(3, 43).reshape(2, 20) % 256
RELATIVE = 1e-4  # the acceptance bound on the logits, relative to their largest magnitude

# Runs in a fresh interpreter: loads each folder with transformers alone and compares with quantlab's logits.
_LOADER = """
import json, sys, torch
from transformers import AutoModelForCausalLM
results = []
for folder, reference in json.loads(sys.argv[1]):
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        logits = model(torch.load(reference)["ids"]).logits
    expected = torch.load(reference)["logits"]
    relative = float((logits - expected).abs().max() / expected.abs().max())
    results.append({"relative": relative, "dtype": str(model.dtype)})
results.append({"quantlab_imported": any(name.split(".")[0] == "quantlab" for name in sys.modules)})
print(json.dumps(results))
"""


def load_without_quantlab(cases: list[tuple[Path, Path]]) -> list[dict]:
    """Load every exported folder in one subprocess that never imports quantlab; its results, checked."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(QUANTLAB_AUTOLOAD="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    payload = json.dumps([[str(folder), str(reference)] for folder, reference in cases])
    done = subprocess.run(
        [sys.executable, "-c", _LOADER, payload], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    *results, imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == {"quantlab_imported": False}
    return results


def exported(model, folder: Path) -> tuple[Path, Path]:
    """Export `model` to `folder`; quantlab's own logits of `IDS` beside it, for the loader."""
    to_compressed_tensors(model, folder)
    with torch.no_grad():
        logits = model(IDS).logits
    reference = folder.with_suffix(".pt")
    torch.save({"ids": IDS, "logits": logits}, reference)
    return folder, reference


def gptq_4bit(model):
    config = quantlab.CustomBitsConfig(
        bits=4, group_size=32, symmetric=True, solver="gptq", calibration_samples=4, calibration_seq_len=32
    )
    calibration = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    return quantlab.quantize(model, config, calibration=calibration, progress=False)


CASES = {
    "llama-rtn-int4-fp16": lambda: quantlab.quantize(
        tiny_llama(), quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, scale_dtype="float16")
    ),
    "llama-gptq-int4": lambda: gptq_4bit(tiny_llama()),
    "qwen2-gptq-int4": lambda: gptq_4bit(tiny_qwen2()),
    "llama-int8-channel": lambda: quantlab.quantize(tiny_llama(seed=1), quantlab.Int8SymmetricConfig()),
    "qwen2-int8-g32-bf16": lambda: quantlab.quantize(
        tiny_qwen2(), quantlab.CustomBitsConfig(bits=8, group_size=32, symmetric=True, scale_dtype="bfloat16")
    ),
    "llama-tied-int4-embedding-int8": lambda: quantlab.quantize(
        tiny_llama(tie_word_embeddings=True),
        quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, embedding_bits=8),
    ),
}


@pytest.mark.subprocess
def test_exports_load_without_quantlab_with_quantlab_logits(tmp_path) -> None:
    cases = [exported(build(), tmp_path / name) for name, build in CASES.items()]
    results = load_without_quantlab(cases)
    for name, result in zip(CASES, results, strict=True):
        assert result["relative"] <= RELATIVE, (name, result)
        assert result["dtype"] == "torch.float32", (name, result)


def test_stored_tensors_are_quantlabs_codes_and_scales(tmp_path) -> None:
    config = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, scale_dtype="float16")
    model = quantlab.quantize(tiny_qwen2(), config)
    report = to_compressed_tensors(model, tmp_path / "out")
    layer = model.model.layers[1].mlp.down_proj
    codes, _ = layer.codes_and_params()
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as handle:
        packed = handle.get_tensor("model.layers.1.mlp.down_proj.weight_packed")
        scale = handle.get_tensor("model.layers.1.mlp.down_proj.weight_scale")
        names = set(handle.keys())
        assert "model.layers.1.mlp.down_proj.weight_zero_point" not in names
        assert handle.get_tensor("model.layers.1.mlp.down_proj.weight_shape").tolist() == [64, 192]
    assert torch.equal(ct.unpack_int32(packed, 4, 192), grouping.ungroup(codes, 192))
    assert scale.dtype == torch.float16 and torch.equal(scale, layer.weight_scale)
    assert report.scheme_counts() == {"int4 g32 sym": 14}
    assert report.ignore == ["lm_head"]
    written = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert written["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert written["ignore"] == ["lm_head"] and written["format"] == "pack-quantized"


def test_config_is_one_compressed_tensors_reads(tmp_path) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    config = quantlab.CustomBitsConfig(
        bits=4, group_size=32, symmetric=True, layer_options={"model.layers.0.mlp.down_proj": {"bits": 8}}
    )
    to_compressed_tensors(quantlab.quantize(tiny_llama(), config), tmp_path / "mixed")
    entry = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(entry)
    schemes = {tuple(group.targets): group.weights.num_bits for group in parsed.config_groups.values()}
    assert schemes[("model.layers.0.mlp.down_proj",)] == 8
    assert len(next(targets for targets, bits in schemes.items() if bits == 4)) == 13


def test_tied_embedding_table_is_written_in_float_and_reported(tmp_path) -> None:
    config = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, embedding_bits=8)
    model = quantlab.quantize(tiny_llama(tie_word_embeddings=True), config)
    report = to_compressed_tensors(model, tmp_path / "tied")
    assert report.ignore == ["lm_head"]
    assert any("model.embed_tokens" in note and "float" in note for note in report.notes)
    with safe_open(tmp_path / "tied" / "model.safetensors", "pt") as handle:
        table = handle.get_tensor("model.embed_tokens.weight")
        names = set(handle.keys())
        assert "lm_head.weight" not in names
    assert torch.equal(table, model.model.embed_tokens.dequantize_weight(torch.float32))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (quantlab.NF4Config(), "NF4 codes index 16 normal-quantile levels"),
        (quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=False), "zero points are fractions"),
        (quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True), "3-bit codes"),
    ],
)
def test_layers_no_scheme_holds_are_refused_by_name(tmp_path, config, message) -> None:
    model = quantlab.quantize(tiny_llama(), config)
    with pytest.raises(CompressedTensorsExportError, match=message) as caught:
        to_compressed_tensors(model, tmp_path / "out")
    assert str(caught.value).startswith("model.layers.0.self_attn.q_proj")
    assert list(tmp_path.iterdir()) == []


def test_float_tied_head_is_reported(tmp_path) -> None:
    config = quantlab.CustomBitsConfig(bits=8, group_size=None, symmetric=True)
    report = to_compressed_tensors(quantlab.quantize(tiny_llama(tie_word_embeddings=True), config), tmp_path / "out")
    assert report.ignore == ["lm_head"] and report.notes == ["lm_head: tied to the embedding table, which stays float"]
    assert report.scheme_counts() == {"int8 per channel sym": 14}


def test_padded_groups_are_refused(tmp_path) -> None:
    model = quantlab.quantize(tiny_llama(), quantlab.CustomBitsConfig(bits=4, group_size=128, symmetric=True))
    with pytest.raises(CompressedTensorsExportError, match="do not split into groups of 128"):
        to_compressed_tensors(model, tmp_path / "out")
