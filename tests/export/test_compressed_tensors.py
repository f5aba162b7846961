"""compressed-tensors export: quantlab's codes as a checkpoint transformers loads with the compressed-tensors
package, in a process that never imports quantlab, with quantlab's logits, across the architecture matrix."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import quantlab
from quantlab.export import to_compressed_tensors
from quantlab.export.compressed_tensors import CompressedTensorsExportError
from quantlab.formats import grouping
from quantlab.interop import compressed_tensors as ct
from quantlab.nn.quantized_experts import QuantizedExperts
from quantlab.testing import tiny_llama
from quantlab.testing.architectures import ARCHITECTURES, tiny_causal_lm
from quantlab.testing.models import tiny_qwen2
from quantlab.workflows.quantize import quantize_to_checkpoint

pytest.importorskip("compressed_tensors")

IDS = torch.arange(3, 43).reshape(2, 20) % 256
RELATIVE = 1e-4  # the acceptance bound on the logits, relative to their largest magnitude

# Runs in a fresh interpreter: loads each folder with transformers alone and compares with quantlab's logits.
# A reference may ask for `CompressedTensorsConfig(dequantize=True)` and name weights the model must hold exactly.
_LOADER = """
import json, sys, torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig
results = []
for folder, path in json.loads(sys.argv[1]):
    reference = torch.load(path)
    options = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if reference.get("dequantize") else {}
    model = AutoModelForCausalLM.from_pretrained(folder, **options)
    with torch.no_grad():
        logits = model(reference["ids"]).logits
    expected = reference["logits"]
    relative = float((logits - expected).abs().max() / expected.abs().max())
    weights = reference.get("weights", {})
    unequal = [name for name, weight in weights.items() if not torch.equal(model.get_parameter(name).detach(), weight)]
    results.append({"relative": relative, "dtype": str(model.dtype), "weights": len(weights), "unequal": unequal})
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


def exported(model, folder: Path, dequantize: bool = False) -> tuple[Path, Path]:
    """Export `model` to `folder`; quantlab's own logits of `IDS` beside it, and each quantized experts projection
    dequantized (what transformers must hold), for the loader; `dequantize`: load with `dequantize=True`."""
    to_compressed_tensors(model, folder)
    with torch.no_grad():
        logits = model(IDS).logits
    weights = {
        f"{name}.{projection}": module.dequantize_projection(projection, torch.float32)
        for name, module in model.named_modules()
        if isinstance(module, QuantizedExperts)
        for projection in module.layouts
    }
    reference = folder.with_suffix(".pt")
    torch.save({"ids": IDS, "logits": logits, "weights": weights, "dequantize": dequantize}, reference)
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
    report = to_compressed_tensors(quantlab.quantize(tiny_llama(), config), tmp_path / "mixed")
    entry = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(entry)
    schemes = {tuple(group.targets): group.weights.num_bits for group in parsed.config_groups.values()}
    assert schemes[("model.layers.0.mlp.down_proj",)] == 8
    assert len(next(targets for targets, bits in schemes.items() if bits == 4)) == 13
    assert any("without CompressedTensorsConfig(dequantize=True)" in note for note in report.notes)


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


# -- mixtures of experts ---------------------------------------------------------------------------


def int4_experts(model_type: str, **options):
    """A tiny mixture of experts quantized to int4 g32 (float16 scales unless `options` say otherwise)."""
    config = quantlab.CustomBitsConfig(**{"bits": 4, "group_size": 32, "symmetric": True, **options})
    return quantlab.quantize(tiny_causal_lm(model_type), config, progress=False)


def experts_int8(model_type: str):
    """Experts in int8 per channel, every other layer in int4 g32: two schemes, the experts' named by pattern."""
    projections = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]
    options = {name: {"bits": 8, "group_size": None} for name in projections}
    return int4_experts(model_type, scale_dtype="float32", layer_options=options)


def streamed_int4_experts(model_type: str):
    """Quantized by the quantize workflow (block by block, the experts stored fused as the model holds them), then
    loaded: a model that records no checkpoint conversion, yet must be exported per expert all the same."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as scratch:
        tiny_causal_lm(model_type).save_pretrained(Path(scratch) / "float")
        config = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True)
        quantize_to_checkpoint(Path(scratch) / "float", config, Path(scratch) / "quantized")
        return AutoModelForCausalLM.from_pretrained(Path(scratch) / "quantized").eval()


# name -> (the quantized model, load with dequantize=True)
EXPERTS_CASES = {
    "qwen3_moe-int4": (lambda: int4_experts("qwen3_moe"), False),
    "mixtral-int4": (lambda: int4_experts("mixtral"), False),
    "olmoe-int8-channel": (lambda: quantlab.quantize(tiny_causal_lm("olmoe"), quantlab.Int8SymmetricConfig()), False),
    "mixtral-int4-q_proj-int8": (
        lambda: int4_experts("mixtral", layer_options={"model.layers.0.self_attn.q_proj": {"bits": 8}}),
        False,
    ),
    "qwen3_moe-int4-layer0-experts-float": (
        lambda: int4_experts("qwen3_moe", modules_to_not_convert=["model.layers.0.mlp.experts"]),
        False,
    ),
    "qwen3_moe-int4-fp32-dequantized": (lambda: int4_experts("qwen3_moe", scale_dtype="float32"), True),
    "qwen3_moe-int4-streamed": (lambda: streamed_int4_experts("qwen3_moe"), False),
    "mixtral-int4-streamed": (lambda: streamed_int4_experts("mixtral"), False),
    "qwen3_moe-experts-int8-dequantized": (lambda: experts_int8("qwen3_moe"), True),
}


@pytest.mark.subprocess
def test_experts_load_without_quantlab_as_quantlab_decodes_them(tmp_path) -> None:
    cases = [exported(build(), tmp_path / name, dequantize) for name, (build, dequantize) in EXPERTS_CASES.items()]
    results = load_without_quantlab(cases)
    for name, result in zip(EXPERTS_CASES, results, strict=True):
        assert result["weights"] in (2, 4) and result["unequal"] == [], (name, result)
        assert result["relative"] <= RELATIVE, (name, result)
        assert result["dtype"] == "torch.float32", (name, result)


@pytest.mark.parametrize(
    ("model_type", "block", "gate", "up", "down"),
    [
        ("qwen3_moe", "model.layers.1.mlp", "gate_proj", "up_proj", "down_proj"),
        ("mixtral", "model.layers.1.block_sparse_moe", "w1", "w3", "w2"),
    ],
    ids=["qwen3_moe", "mixtral"],
)
def test_experts_are_written_per_expert_under_the_checkpoint_names(tmp_path, model_type, block, gate, up, down) -> None:
    model = int4_experts(model_type)
    report = to_compressed_tensors(model, tmp_path / "out")
    experts = model.model.layers[1].mlp.experts
    rows = experts.intermediate_size
    written = {  # checkpoint layer -> (projection, its rows of the expert's slice)
        gate: ("gate_up_proj", slice(0, rows)),
        up: ("gate_up_proj", slice(rows, 2 * rows)),
        down: ("down_proj", slice(None)),
    }
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as handle:
        stored = set(handle.keys())
        assert not any(key.endswith(("gate_up_proj", "gate_up_proj_scale", "down_proj_scale")) for key in stored)
        assert f"{block}.gate.weight" in stored  # the router, named as the experts are
        for expert in range(experts.num_experts):
            for layer, (projection, part) in written.items():
                piece = experts.slices(projection)[expert]
                grid = piece.layout.codec_object.integer_grid(piece.layout, piece.stored_tensors())
                name = f"{block}.experts.{expert}.{layer}"
                packed, scale = handle.get_tensor(f"{name}.weight_packed"), handle.get_tensor(f"{name}.weight_scale")
                assert torch.equal(ct.unpack_int32(packed, 4, piece.in_features), grid.codes[part]), name
                assert scale.dtype == torch.float32 and torch.equal(scale, grid.scale[part].float()), name
    assert report.scheme_counts() == {"int4 g32 sym": 8 + 2 * 3 * experts.num_experts}
    assert report.notes[0].startswith("model.layers.0.mlp.experts and 1 more experts modules: transformers'")
    assert "quantlab stores in float16 are written in float32, the same numbers" in report.notes[1]
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["targets"] == ["Linear"]


def test_experts_in_their_own_scheme_are_the_group_transformers_reads_them_with(tmp_path) -> None:
    from compressed_tensors.quantization import QuantizationConfig
    from transformers.integrations.compressed_tensors import get_dense_scheme, get_experts_scheme

    report = to_compressed_tensors(experts_int8("mixtral"), tmp_path / "out")
    assert not any("dequantize=True)" in note for note in report.notes)  # one scheme for the other layers
    entry = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(entry)
    assert get_experts_scheme(parsed).weights.num_bits == 8 and get_dense_scheme(parsed).weights.num_bits == 4
    groups, _ = ct.read_config(entry)
    assert ct.group_of("model.layers.1.block_sparse_moe.experts.3.w2", groups).scheme.bits == 8
    assert ct.group_of("model.layers.1.self_attn.q_proj", groups).scheme.bits == 4


def _asymmetric_experts():
    """Experts with zero points that are whole numbers (rounded, as an imported checkpoint's are)."""
    model = int4_experts("qwen3_moe", symmetric=False, scale_dtype="float32")
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("zero"):
                buffer.copy_(buffer.round())
    return model


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: int4_experts("qwen3_moe", layer_options={"model.layers.0.mlp.experts.down_proj": {"bits": 8}}),
            "loader reads every expert with one scheme",
        ),
        (_asymmetric_experts, "reads no zero points for experts"),
        (
            lambda: int4_experts("qwen3_moe").to(torch.bfloat16),
            "the model's bfloat16 does not hold its float16 scales exactly",
        ),
    ],
    ids=["experts-in-two-schemes", "asymmetric-experts", "float16-scales-in-bfloat16"],
)
def test_experts_transformers_cannot_load_are_refused_in_one_line(tmp_path, build, message) -> None:
    with pytest.raises(CompressedTensorsExportError, match=message) as caught:
        to_compressed_tensors(build(), tmp_path / "out")
    assert "\n" not in str(caught.value) and str(caught.value).startswith("model.layers.0.mlp.experts")
    assert list(tmp_path.iterdir()) == []


# -- the architecture matrix --------------------------------------------------------------------------------

REFUSED = {  # the architectures whose checkpoints transformers cannot load, and why
    "gpt2": r"transformer\.h\.0\.attn\.c_attn and 7 more .*builds .* as a Conv1D",
    "falcon": r"a falcon model cannot be written as compressed-tensors: transformers' Falcon initializes",
}


def _matrix_model(model_type: str):
    # DeepSeek-V3's kv_b_proj reads 16 inputs: one group per row there (integer grids store no padded groups)
    options = {f"model.layers.{i}.self_attn.kv_b_proj": {"group_size": None} for i in range(2)}
    config = quantlab.CustomBitsConfig(
        bits=4, group_size=32, symmetric=True, layer_options=options if model_type == "deepseek_v3" else None
    )
    return quantlab.quantize(tiny_causal_lm(model_type), config, progress=False)


@pytest.mark.subprocess
def test_every_loadable_architecture_loads_without_quantlab_with_quantlab_logits(tmp_path) -> None:
    model_types = [model_type for model_type in ARCHITECTURES if model_type not in REFUSED]
    results = load_without_quantlab([exported(_matrix_model(name), tmp_path / name) for name in model_types])
    for model_type, result in zip(model_types, results, strict=True):
        assert result["relative"] <= RELATIVE, (model_type, result)
        assert result["unequal"] == [], (model_type, result)


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_architectures_transformers_cannot_load_are_refused(model_type, tmp_path) -> None:
    with pytest.raises(CompressedTensorsExportError, match=REFUSED[model_type]):
        to_compressed_tensors(_matrix_model(model_type), tmp_path / "out")
    assert not (tmp_path / "out").exists()
