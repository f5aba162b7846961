"""Import of AWQ checkpoints (AutoAWQ / GPTQModel "gemm" layout) into quantlab's storage.

No AWQ library installs here (AutoAWQ builds CUDA extensions and pins an older transformers), so the
checkpoints are packed by the test itself, following the documented layout (`quantlab.interop.awq`)
with its own loops rather than quantlab's unpacking: codes `[in, out]` packed along the output
dimension, eight to an int32 word in the order 0, 2, 4, 6, 1, 3, 5, 7; zero points likewise.
"""

import json

import pytest
import torch

import quantlab
from quantlab.formats import grouping
from quantlab.interop import ForeignCheckpointError
from quantlab.nn import QuantizedLinear
from quantlab.testing import tiny_llama
from quantlab.testing.foreign_checkpoints import save_packed_checkpoint
from quantlab.testing.models import tiny_qwen2

IDS = torch.arange(7, 47).reshape(2, 20) % 256
PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the feature each nibble of a word holds, as AutoAWQ's GEMM packer writes


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values `[rows, cols]` → int32 `[rows, cols / 8]` in AWQ's interleaved order."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for word in range(cols // 8):
        for nibble in range(8):
            words[:, word] |= values[:, 8 * word + PACK_ORDER[nibble]].to(torch.int64) << (4 * nibble)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_awq(model, folder, group_size: int, version: str = "gemm"):
    """Quantize every Linear layer but the head on AWQ's min-max 4-bit grid and save it as AutoAWQ's GEMM
    packer would; returns each layer's codes, zero points and scales, and the float model of their values."""
    state, source = {}, {}
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or name == "lm_head":
            continue
        weight = module.weight.detach()
        out, cols = weight.shape
        grouped = weight.reshape(out, cols // group_size, group_size)
        low, high = grouped.amin(-1), grouped.amax(-1)
        scale = ((high - low).clamp(min=1e-5) / 15).to(torch.float16)
        zero = torch.round(-low / scale.float()).clamp(0, 15).to(torch.int64)
        codes = torch.round(grouped / scale.float().unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15).to(torch.int64)
        codes = codes.reshape(out, cols)
        state |= {
            f"{name}.qweight": pack_columns(codes.t()),
            f"{name}.qzeros": pack_columns(zero.t()),
            f"{name}.scales": scale.t().contiguous(),
        }
        if module.bias is not None:
            state[f"{name}.bias"] = module.bias.detach().clone()
        source[name] = {"codes": codes, "zero": zero, "scale": scale}
        decoded = (codes.reshape(out, -1, group_size) - zero.unsqueeze(-1)) * scale.float().unsqueeze(-1)
        module.weight.data.copy_(decoded.reshape(out, cols))
    save_packed_checkpoint(
        model,
        folder,
        state,
        source,
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": version,
            "modules_to_not_convert": None,
        },
    )
    return source, model


@pytest.mark.parametrize(("build", "group_size"), [(tiny_llama, 32), (tiny_qwen2, 64)], ids=["llama-g32", "qwen2-g64"])
def test_codes_scales_and_zero_points_are_the_checkpoints(tmp_path, build, group_size) -> None:
    source, reference = write_awq(build(), tmp_path / "awq", group_size)
    model = quantlab.load(tmp_path / "awq")
    layers = {name: module for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    assert sorted(layers) == sorted(source)
    for name, numbers in source.items():
        layer = layers[name]
        codes, params = layer.codes_and_params()
        assert torch.equal(grouping.ungroup(codes, layer.in_features).long(), numbers["codes"]), name
        assert torch.equal(layer.weight_scale, numbers["scale"]), name
        assert torch.equal(params.zero, numbers["zero"].float()), name
    with torch.no_grad():
        expected, logits = reference(IDS).logits, model(IDS).logits
    assert float((logits - expected).abs().max() / expected.abs().max()) <= 1e-4


def test_eval_reads_an_awq_checkpoint(tmp_path, capsys) -> None:
    from quantlab.cli.main import main
    from quantlab.testing import byte_tokenizer

    write_awq(tiny_llama(), tmp_path / "awq", 32)
    byte_tokenizer().save_pretrained(tmp_path / "awq")
    assert main(["eval", str(tmp_path / "awq"), "--seq-len", "32", "--windows", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["perplexity"] > 0


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"version": "gemv"}, "AWQ version 'gemv' packs codes for one kernel"),
        ({"version": "exllama"}, "AWQ version 'exllama' packs codes for one kernel"),
        ({"zero_point": False}, "zero_point=false"),
        ({"bits": 3}, "3-bit AWQ codes"),
    ],
)
def test_other_packings_are_refused(tmp_path, edit, message) -> None:
    write_awq(tiny_llama(), tmp_path / "awq", 32)
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"].update(edit)
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ForeignCheckpointError, match=message):
        quantlab.load(tmp_path / "awq")
