"""Checkpoints written by other libraries' own code, for the import tests (the `compressed_tensors_writer` fixture, and
`compressed_tensors_experts_writer` for mixtures of experts)."""

import pytest
import torch
from torch import nn


def write_compressed_tensors(model, folder, schemes: dict[str, dict], fmt: str = "pack-quantized") -> dict:
    """Quantize `model`'s Linear layers (less `lm_head`) with compressed-tensors' own code, min-max
    scales from its `calculate_qparams`, and save it with its `ModelCompressor` in format `fmt`.

    `schemes`: config group name → `QuantizationArgs` options, plus `targets`. Returns each layer's
    source numbers: signed int8 codes `[out, in]` (compressed-tensors' `quantize`), scales, zero points.
    """
    source, compressor = quantize_with_compressed_tensors(model, schemes, ["lm_head"], fmt)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return source


def write_compressed_tensors_experts(model, folder, schemes: dict[str, dict], ignore: tuple[str, ...] = ()) -> dict:
    """`write_compressed_tensors` for a mixture of experts: its tensors as transformers saves them (one Linear
    layer per expert and projection), each 2-D weight an `nn.Linear` of a plain module tree that compressed-tensors
    quantizes and compresses (the routers, embeddings, head and `ignore` stay float); saved with the model's config."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    tree = _module_tree(revert_weight_conversion(model, dict(model.state_dict())))
    ignore = ["lm_head", "model.embed_tokens", r"re:.*\.gate$", *ignore]
    source, compressor = quantize_with_compressed_tensors(tree, schemes, ignore, "pack-quantized")
    compressor.compress_model(tree)
    folder.mkdir()
    state = {key: tensor.detach().contiguous() for key, tensor in tree.state_dict().items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    compressor.update_config(folder)
    return source


def _module_tree(state: dict[str, torch.Tensor]) -> nn.Module:
    """Plain modules holding `state` under its names, every 2-D `.weight` in an `nn.Linear` layer."""
    root = nn.Module()
    for key, tensor in state.items():
        path, _, name = key.rpartition(".")
        if name == "weight" and tensor.dim() == 2:
            parent, _, child = path.rpartition(".")
            _submodule(root, parent).add_module(child, nn.Linear(tensor.shape[1], tensor.shape[0], bias=False))
    for key, tensor in state.items():
        path, _, name = key.rpartition(".")
        module = _submodule(root, path)
        if name in module._parameters:
            module._parameters[name].data = tensor.detach().clone()
        else:
            module.register_parameter(name, nn.Parameter(tensor.detach().clone(), requires_grad=False))
    return root


def _submodule(root: nn.Module, path: str) -> nn.Module:
    """The module at `path` under `root`, plain modules made for the missing parts."""
    module = root
    for part in path.split(".") if path else []:
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]
    return module


def quantize_with_compressed_tensors(model: nn.Module, schemes: dict[str, dict], ignore: list[str], fmt: str):
    """Apply `schemes` to `model` with compressed-tensors, set min-max scales, and return each quantized layer's
    source numbers and the `ModelCompressor` that compresses it in format `fmt`."""
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
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=ignore), show_progress=False)
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
    return source, ModelCompressor.from_pretrained_model(model, fmt)


@pytest.fixture
def compressed_tensors_writer():
    pytest.importorskip("compressed_tensors")
    return write_compressed_tensors


@pytest.fixture
def compressed_tensors_experts_writer():
    pytest.importorskip("compressed_tensors")
    return write_compressed_tensors_experts
