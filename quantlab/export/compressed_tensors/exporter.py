"""`to_compressed_tensors`: a transformers model quantized by quantlab as a compressed-tensors checkpoint folder."""

import copy
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantlab.errors import QuantlabError
from quantlab.formats.codec import NotAnIntegerGrid
from quantlab.interop import compressed_tensors as ct
from quantlab.nn import QuantizedLinear, QuantizedOutputHead, TiedOutputHead
from quantlab.nn.quantized_embedding import QuantizedTable
from quantlab.nn.quantized_experts import experts_modules, experts_refusal
from quantlab.nn.rotation import refusal, rotated_layers
from quantlab.utils.atomic import atomic_directory, check_replaceable

# The compressed-tensors release whose layout the files follow (its `version` key).
FORMAT_VERSION = "0.20.0"
MAX_SHARD_SIZE = "5GB"


class CompressedTensorsExportError(QuantlabError, ValueError):
    """A model cannot be written as compressed-tensors exactly; the message names the layer and why."""


@dataclass(frozen=True)
class ExportedLayer:
    """One quantized Linear layer as written: its module name and scheme (`int4 g32 sym`)."""

    name: str
    scheme: str


@dataclass
class CompressedTensorsExport:
    """What `to_compressed_tensors` wrote: the folder, its size, the quantized layers and the float ones (`ignore`)."""

    path: Path
    bytes: int
    layers: list[ExportedLayer] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def scheme_counts(self) -> dict[str, int]:
        return dict(Counter(layer.scheme for layer in self.layers))

    def to_json(self) -> dict[str, Any]:
        return {
            "output": str(self.path),
            "bytes": self.bytes,
            "format": ct.PACKED_FORMAT,
            "schemes": self.scheme_counts(),
            "layers": [{"name": layer.name, "scheme": layer.scheme} for layer in self.layers],
            "ignore": self.ignore,
            "notes": self.notes,
        }


def to_compressed_tensors(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    tokenizer: Any = None,
    overwrite: bool = False,
) -> CompressedTensorsExport:
    """Write `model` (and `tokenizer`) to the folder `directory` as a compressed-tensors checkpoint.

    `AutoModelForCausalLM.from_pretrained(directory)` then loads it with the `compressed-tensors`
    package and without quantlab; its weights decode to quantlab's exactly (scales keep their dtype).
    Every layer is checked before anything is written; the folder is staged beside `directory` and
    renamed into place. `overwrite` replaces an existing folder.
    """
    directory = Path(directory).expanduser()
    check_replaceable(directory, overwrite)
    if not hasattr(model, "config") or not hasattr(model, "state_dict"):
        raise CompressedTensorsExportError(
            f"a {type(model).__name__} has no transformers config; export a transformers model"
        )
    rotated = rotated_layers(model)
    if rotated:
        raise CompressedTensorsExportError(refusal(rotated, "compressed-tensors"))
    experts = experts_modules(model)
    if experts:
        raise CompressedTensorsExportError(experts_refusal(experts, "compressed-tensors"))
    converted = _Converted.of(model)
    if not converted.schemes:
        raise CompressedTensorsExportError(
            "the model has no quantized Linear layer; quantize it (custom_bits 4-bit or int8) before exporting"
        )
    by_scheme: dict[ct.Scheme, list[str]] = {}
    for name, scheme in converted.schemes.items():
        by_scheme.setdefault(scheme, []).append(name)
    config = _config_json(model, ct.quantization_config(by_scheme, converted.ignore, FORMAT_VERSION))
    with atomic_directory(directory, overwrite=overwrite) as staging:
        _write(staging, converted.state, config)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    size = sum(file.stat().st_size for file in directory.iterdir() if file.suffix == ".safetensors")
    layers = [ExportedLayer(name, scheme.label()) for name, scheme in converted.schemes.items()]
    return CompressedTensorsExport(directory, size, layers, sorted(converted.ignore), converted.notes)


@dataclass
class _Converted:
    """The checkpoint's tensors by name, each quantized layer's scheme, the float Linear layers, and notes."""

    state: dict[str, torch.Tensor]
    schemes: dict[str, ct.Scheme] = field(default_factory=dict)
    ignore: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, model: nn.Module) -> "_Converted":
        state = dict(model.state_dict())
        for key in getattr(model, "all_tied_weights_keys", None) or {}:
            state.pop(key, None)  # written once, under the tensor it is tied to
        converted = cls(state)
        for name, module in model.named_modules():
            converted.add(model, name, module)
        converted.state = {key: tensor.detach().cpu().contiguous() for key, tensor in converted.state.items()}
        return converted

    def add(self, model: nn.Module, name: str, module: nn.Module) -> None:
        if isinstance(module, QuantizedLinear):
            self.schemes[name], tensors = _layer(name, module)
            self.replace(name, module.stored_tensor_names(), tensors)
        elif isinstance(module, QuantizedTable):
            weight = module.dequantize_weight(_float_dtype(model))
            self.replace(name, module.stored_tensor_names(), {"weight": weight})
            self.notes.append(
                f"{name}: the {module.kind} table quantlab stores in {module.layout.bits} bits is written in float "
                f"(compressed-tensors checkpoints keep vocabulary tables float)"
            )
            if isinstance(module, QuantizedOutputHead):
                self.ignore.append(name)
        elif isinstance(module, TiedOutputHead):
            self.ignore.append(name)
            self.notes.append(f"{name}: tied to the embedding table, which is written in float")
        elif isinstance(module, nn.Linear):
            self.ignore.append(name)
            if f"{name}.weight" in (getattr(model, "all_tied_weights_keys", None) or {}):
                self.notes.append(f"{name}: tied to the embedding table, which stays float")

    def replace(self, prefix: str, stored: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> None:
        for name in stored:
            self.state.pop(f"{prefix}.{name}", None)
        self.state.update({f"{prefix}.{name}": tensor for name, tensor in tensors.items()})


def _layer(name: str, module: QuantizedLinear) -> tuple[ct.Scheme, dict[str, torch.Tensor]]:
    """A quantized layer's scheme and pack-quantized tensors; the reason in one line when it has none."""
    layout = module.layout
    label = f"{layout.codec_object.label(layout)} {layout.bits}-bit"
    if layout.bits not in ct.BITS:
        raise CompressedTensorsExportError(
            f"{name} ({label}) cannot be written as compressed-tensors: its {layout.bits}-bit codes have no "
            f"compressed-tensors kernel (int4 and int8 do); quantize it with 4 or 8 bits"
        )
    stored = {key: tensor.detach().cpu() for key, tensor in module.stored_tensors().items()}
    try:
        grid = layout.codec_object.integer_grid(layout, stored)
    except NotAnIntegerGrid as error:
        raise CompressedTensorsExportError(
            f"{name} ({label}) cannot be written as compressed-tensors: {error}"
        ) from None
    return ct.Scheme(grid.bits, grid.group_size, grid.symmetric), ct.layer_tensors(grid)


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's float parameters (what its float layers are written in)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def _config_json(model: nn.Module, quantization: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = _float_dtype(model)
    data = config.to_dict()
    data["quantization_config"] = quantization
    return data


def _write(folder: Path, state: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """The tensors as safetensors shards of at most `MAX_SHARD_SIZE` (with an index when there are several)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from quantlab.loading import io_errors_as_os_errors

    split = split_torch_state_dict_into_shards(state, max_shard_size=MAX_SHARD_SIZE)
    with io_errors_as_os_errors(folder):
        for filename, keys in split.filename_to_tensors.items():
            save_file({key: state[key] for key in keys}, folder / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {
            "metadata": {"total_size": split.metadata.get("total_size", 0)},
            "weight_map": split.tensor_to_filename,
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
