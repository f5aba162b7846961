"""Checkpoints written by other libraries' own code, for the import tests (the `write_compressed_tensors` fixture)."""

import pytest
import torch


def write_compressed_tensors(model, folder, schemes: dict[str, dict], fmt: str = "pack-quantized") -> dict:
    """Quantize `model`'s Linear layers (less `lm_head`) with compressed-tensors' own code, min-max
    scales from its `calculate_qparams`, and save it with its `ModelCompressor` in format `fmt`.

    `schemes`: config group name → `QuantizationArgs` options, plus `targets`. Returns each layer's
    source numbers: signed int8 codes `[out, in]` (compressed-tensors' `quantize`), scales, zero points.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    groups = {}
    for name, options in schemes.items():
        options = dict(options)
        targets = options.pop("targets", ["Linear"])
        groups[name] = QuantizationScheme(targets=targets, weights=QuantizationArgs(**options))
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=["lm_head"]), show_progress=False)
    source = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        args, weight = scheme.weights, module.weight.data
        grouped = weight.reshape(weight.shape[0], -1, args.group_size or weight.shape[1])
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        zero_point = getattr(module, "weight_zero_point", None)
        if zero_point is not None:
            zero_point.data.copy_(zero.reshape(zero_point.shape))
        codes = quantize(weight, module.weight_scale, zero_point, args, dtype=torch.int8)
        source[name] = {
            "codes": codes,
            "scale": module.weight_scale.detach().clone(),
            "zero": None if zero_point is None or args.symmetric else zero_point.detach().clone(),
            "bits": args.num_bits,
        }
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return source


@pytest.fixture
def compressed_tensors_writer():
    pytest.importorskip("compressed_tensors")
    return write_compressed_tensors
