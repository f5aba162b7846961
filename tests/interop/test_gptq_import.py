"""Import of GPTQ checkpoints (AutoGPTQ / GPTQModel layout) into quantlab's storage.

No GPTQ library installs here (AutoGPTQ and GPTQModel build CUDA extensions), so the checkpoints are
packed by the test itself, following the documented layout (`quantlab.interop.gptq`) with its own
loops rather than quantlab's unpacking: qweight packed along the input dimension, qzeros along the
output dimension, v1 zero points stored minus one, g_idx the group of each input feature.
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


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values `[n, cols]` → int32 `[n // (32 / bits), cols]`: value of row `r` at bit `bits * (r % per)`."""
    per = 32 // bits
    words = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for j in range(per):
        words |= values[j::per].to(torch.int64) << (bits * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_gptq(model, folder, bits: int, group_size: int, sym: bool, fmt: str = "gptq", act_order: bool = False):
    """Quantize every Linear layer but the head by min-max GPTQ grids and save the checkpoint as AutoGPTQ
    (`fmt` "gptq") or GPTQModel ("gptq_v2") would; returns each layer's codes, zero points, scales and
    the float model holding the weights those decode to."""
    top = (1 << bits) - 1
    state, source = {}, {}
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or name == "lm_head":
            continue
        weight = module.weight.detach()
        out, cols = weight.shape
        group = cols if group_size == -1 else group_size
        grouped = weight.reshape(out, cols // group, group)
        if sym:
            scale = (grouped.abs().amax(-1) * 2 / top).to(torch.float16)
            zero = torch.full_like(scale, (top + 1) // 2, dtype=torch.int64)
        else:
            low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
            scale = ((high - low) / top).to(torch.float16)
            zero = torch.round(-low / scale.float()).clamp(1, top).to(torch.int64)  # v1 cannot store 0
        codes = torch.round(grouped / scale.float().unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, top).to(torch.int64)
        codes = codes.reshape(out, cols)
        stored_zero = zero - 1 if fmt == "gptq" else zero
        g_idx = torch.arange(cols, dtype=torch.int32) // group
        if act_order:
            g_idx = g_idx[torch.randperm(cols, generator=torch.Generator().manual_seed(0))]
        state |= {
            f"{name}.qweight": pack_rows(codes.t(), bits),
            f"{name}.qzeros": pack_rows(stored_zero, bits).t().contiguous(),
            f"{name}.scales": scale.t().contiguous(),
            f"{name}.g_idx": g_idx,
        }
        if module.bias is not None:
            state[f"{name}.bias"] = module.bias.detach().clone()
        source[name] = {"codes": codes, "zero": zero, "scale": scale}
        decoded = ((codes.reshape(out, -1, group) - zero.unsqueeze(-1)) * scale.float().unsqueeze(-1)).reshape(
            out, cols
        )
        module.weight.data.copy_(decoded)
    save_packed_checkpoint(
        model,
        folder,
        state,
        source,
        {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "sym": sym,
            "desc_act": act_order,
            "checkpoint_format": fmt,
            "true_sequential": True,
        },
    )
    return source, model


CASES = {
    "llama-int4-sym-v1": (tiny_llama, 4, 32, True, "gptq"),
    "llama-int4-asym-v1": (tiny_llama, 4, 32, False, "gptq"),
    "qwen2-int4-asym-v2": (tiny_qwen2, 4, 32, False, "gptq_v2"),
    "qwen2-int8-sym-channel": (tiny_qwen2, 8, -1, True, "gptq"),
    "llama-int2-asym": (tiny_llama, 2, 32, False, "gptq"),
}


@pytest.mark.parametrize("case", CASES)
def test_codes_scales_and_zero_points_are_the_checkpoints(tmp_path, case) -> None:
    build, bits, group_size, sym, fmt = CASES[case]
    source, reference = write_gptq(build(), tmp_path / "gptq", bits, group_size, sym, fmt)
    model = quantlab.load(tmp_path / "gptq")
    layers = {name: module for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    assert sorted(layers) == sorted(source)
    for name, numbers in source.items():
        layer = layers[name]
        codes, params = layer.codes_and_params()
        assert torch.equal(grouping.ungroup(codes, layer.in_features).long(), numbers["codes"]), name
        assert torch.equal(layer.weight_scale, numbers["scale"]), name
        if sym:
            assert not layer.layout.has_zero
        else:
            assert torch.equal(params.zero, numbers["zero"].float()), name
    with torch.no_grad():
        expected, logits = reference(IDS).logits, model(IDS).logits
    assert float((logits - expected).abs().max() / expected.abs().max()) <= 1e-4


def test_act_order_groups_are_refused(tmp_path) -> None:
    write_gptq(tiny_llama(), tmp_path / "gptq", 4, 32, True, act_order=True)
    with pytest.raises(ForeignCheckpointError, match="g_idx puts input features in groups out of order"):
        quantlab.load(tmp_path / "gptq")


def test_backend_formats_are_refused(tmp_path) -> None:
    write_gptq(tiny_llama(), tmp_path / "gptq", 4, 32, True)
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "marlin"
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ForeignCheckpointError, match="checkpoint_format 'marlin'"):
        quantlab.load(tmp_path / "gptq")
