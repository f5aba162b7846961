"""`to_compressed_tensors`: a transformers model quantized by quantlab as a compressed-tensors checkpoint folder."""

import copy
import dataclasses
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantlab.export.compressed_tensors.errors import CompressedTensorsExportError
from quantlab.export.compressed_tensors.experts import ExpertLayer, as_saved, checkpoint_expert_layers
from quantlab.formats.codec import IntegerGrid, NotAnIntegerGrid
from quantlab.interop import compressed_tensors as ct
from quantlab.nn import QuantizedLinear, QuantizedOutputHead, TiedOutputHead
from quantlab.nn.quantized_embedding import QuantizedTable
from quantlab.nn.quantized_experts import ExpertSlice, QuantizedExperts
from quantlab.nn.rotation import refusal, rotated_layers
from quantlab.utils.atomic import atomic_directory, check_replaceable

# The compressed-tensors release whose layout the files follow (its `version` key).
FORMAT_VERSION = "0.20.0"
MAX_SHARD_SIZE = "5GB"

# Model types whose compressed-tensors checkpoints transformers cannot load, and why (measured).
UNLOADABLE = {
    "falcon": "transformers' Falcon initializes every FalconLinear's weight while loading, and compressed-tensors "
    "has replaced that weight by packed codes (AttributeError: 'FalconLinear' object has no attribute 'weight')",
}


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
    package and without quantlab; its weights decode to quantlab's exactly (scales keep their dtype,
    but experts' are written in the model's float dtype: transformers runs experts in it). Every
    layer is checked before anything is written; the folder is staged beside `directory` and
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
    _check_model_type_loads(model)
    converted = _Converted.of(model)
    _check_layers_load_as_linear(model, converted)
    if not converted.schemes:
        raise CompressedTensorsExportError(
            "the model has no quantized Linear layer; quantize it (custom_bits 4-bit or int8) before exporting"
        )
    _check_experts_loadable(converted)
    converted.notes.extend(_loading_notes(converted, _float_dtype(model), converted.float_experts(model)))
    by_scheme: dict[ct.Scheme, list[str]] = {}
    for name, scheme in converted.schemes.items():
        by_scheme.setdefault(scheme, []).append(name)
    quantization = ct.quantization_config(by_scheme, converted.ignore, FORMAT_VERSION, converted.experts)
    config = _config_json(model, quantization)
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
    """The checkpoint's tensors by name, each quantized layer's scheme, the float Linear layers, the experts' layers
    (as the checkpoint names them) and notes."""

    state: dict[str, torch.Tensor]
    schemes: dict[str, ct.Scheme] = field(default_factory=dict)
    ignore: list[str] = field(default_factory=list)
    experts: list[list[str]] = field(default_factory=list)  # one per layer and projection: its name per expert
    experts_modules: list[str] = field(default_factory=list)
    widened_scales: set[torch.dtype] = field(default_factory=set)  # experts' scale dtypes written in the float one
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, model: nn.Module) -> "_Converted":
        state = dict(model.state_dict())
        for key in getattr(model, "all_tied_weights_keys", None) or {}:
            state.pop(key, None)  # written once, under the tensor it is tied to
        converted = cls(state)
        expert_layers = checkpoint_expert_layers(model)
        for name, module in model.named_modules():
            if isinstance(module, QuantizedExperts):
                converted.add_experts(name, module, expert_layers[name], _float_dtype(model))
            else:
                converted.add(model, name, module)
        converted.state = {key: tensor.detach().cpu().contiguous() for key, tensor in converted.state.items()}
        if expert_layers:
            converted.state = converted.named_as_checkpoint(model)
        return converted

    def named_as_checkpoint(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The state with its tensors outside Linear layers (norms, routers) named as transformers saves them, as the
        experts' layers are: Mixtral's router is `block_sparse_moe.gate` beside `block_sparse_moe.experts.3.w1`.
        Linear layers keep the model's names, which the config's targets and `ignore` match; experts left float stay
        fused, as the model holds them: transformers' loader would decode them as codes if they were per expert."""
        kept_modules = set(self.schemes) | set(self.ignore) | set(self.float_experts(model))
        kept = {key: tensor for key, tensor in self.state.items() if key.rpartition(".")[0] in kept_modules}
        others = {key: tensor for key, tensor in self.state.items() if key not in kept}
        return {**kept, **as_saved(model, others)}

    def float_experts(self, model: nn.Module) -> list[str]:
        """The experts modules left float in a model whose other experts are quantized (same class as theirs)."""
        classes = {module.float_class for module in model.modules() if isinstance(module, QuantizedExperts)}
        return [name for name, module in model.named_modules() if type(module) in classes]

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

    def add_experts(self, name: str, module: QuantizedExperts, layers: list["ExpertLayer"], dtype: torch.dtype) -> None:
        """Each expert's slice of each fused projection as the per-expert Linear layers the checkpoint names (gate and
        up from the rows of `gate_up_proj`), every one packed as a quantized Linear layer is, its scales in `dtype`."""
        tensors: dict[str, torch.Tensor] = {}
        families: dict[tuple[str, int], list[str]] = {}
        by_slice: dict[tuple[str, int], list[ExpertLayer]] = {}
        for layer in layers:
            by_slice.setdefault((layer.projection, layer.expert), []).append(layer)
        for projection in module.layouts:
            for expert, piece in enumerate(module.slices(projection)):
                where = f"{name}.{projection} (expert {expert})"
                scheme, grid = _grid(where, piece)
                if grid.scale.dtype != dtype:
                    self.widened_scales.add(grid.scale.dtype)
                grid = _scales_in(grid, dtype, where)
                for layer in by_slice.get((projection, expert), []):
                    self.schemes[layer.name] = scheme
                    families.setdefault((projection, layer.rows.start), []).append(layer.name)
                    part = ct.layer_tensors(_rows(grid, layer.rows))
                    tensors.update({f"{layer.name}.{key}": value for key, value in part.items()})
        for stored in module.stored_tensor_names():
            self.state.pop(f"{name}.{stored}", None)
        self.state.update(tensors)
        self.experts.extend(families.values())
        self.experts_modules.append(name)

    def replace(self, prefix: str, stored: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> None:
        for name in stored:
            self.state.pop(f"{prefix}.{name}", None)
        self.state.update({f"{prefix}.{name}": tensor for name, tensor in tensors.items()})


def _layer(name: str, module: QuantizedLinear) -> tuple[ct.Scheme, dict[str, torch.Tensor]]:
    """A quantized layer's scheme and pack-quantized tensors; the reason in one line when it has none."""
    scheme, grid = _grid(name, module)
    return scheme, ct.layer_tensors(grid)


def _grid(name: str, module: QuantizedLinear | ExpertSlice) -> tuple[ct.Scheme, IntegerGrid]:
    """A quantized layer's (or one expert's slice's) scheme and integer grid; the reason in one line when it has
    none."""
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
    return ct.Scheme(grid.bits, grid.group_size, grid.symmetric), grid


def _scales_in(grid: IntegerGrid, dtype: torch.dtype, name: str) -> IntegerGrid:
    """`grid` with its scales in `dtype`, the model's float dtype: transformers' loader decodes experts in their
    scales' dtype and runs them in it, so other scales would meet float activations of another dtype. Refused when
    `dtype` does not hold the scales exactly."""
    if grid.scale.dtype == dtype:
        return grid
    scale = grid.scale.to(dtype)
    if not torch.equal(scale.to(grid.scale.dtype), grid.scale):
        raise CompressedTensorsExportError(
            f"{name} cannot be written as compressed-tensors: transformers decodes experts in their scales' dtype, "
            f"and the model's {_dtype_name(dtype)} does not hold its {_dtype_name(grid.scale.dtype)} scales exactly; "
            f"quantize with scale_dtype={_dtype_name(dtype)} or convert the model to {_dtype_name(grid.scale.dtype)}"
        )
    return dataclasses.replace(grid, scale=scale)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rows(grid: IntegerGrid, rows: slice) -> IntegerGrid:
    """The output rows `rows` of a grid (the gate or the up half of a fused projection): codes, scales, zero points."""
    zero = None if grid.zero is None else grid.zero[rows]
    return dataclasses.replace(grid, codes=grid.codes[rows], scale=grid.scale[rows], zero=zero)


def _check_model_type_loads(model: nn.Module) -> None:
    model_type = getattr(model.config, "model_type", None)
    if model_type in UNLOADABLE:
        raise CompressedTensorsExportError(
            f"a {model_type} model cannot be written as compressed-tensors: {UNLOADABLE[model_type]}; "
            f"export it to ONNX or keep quantlab's own checkpoint"
        )


def _check_layers_load_as_linear(model: nn.Module, converted: _Converted) -> None:
    """Refuse quantized layers that the model's class builds as something other than an `nn.Linear` (GPT-2's
    `Conv1D`): transformers' compressed-tensors loader replaces Linear modules only and would leave such a layer
    with random weights, silently."""
    experts = {name for family in converted.experts for name in family}
    with torch.device("meta"):
        skeleton = type(model)(copy.deepcopy(model.config))
    built = {name: type(skeleton.get_submodule(name)) for name in converted.schemes if name not in experts}
    other = [name for name, kind in built.items() if not issubclass(kind, nn.Linear)]
    if other:
        kind = built[other[0]].__name__
        more = f" and {len(other) - 1} more" if len(other) > 1 else ""
        raise CompressedTensorsExportError(
            f"{other[0]}{more} cannot be written as compressed-tensors: transformers builds {other[0]} as a {kind}, "
            f"and its compressed-tensors loader quantizes nn.Linear layers only; export the model to ONNX"
        )


def _check_experts_loadable(converted: _Converted) -> None:
    """Refuse experts transformers' compressed-tensors loader cannot decode: it reads every expert with one scheme,
    and no zero points for experts (an asymmetric expert fails to load)."""
    names = [name for family in converted.experts for name in family]
    schemes = {converted.schemes[name] for name in names}
    if len(schemes) > 1:
        labels = ", ".join(sorted(scheme.label() for scheme in schemes))
        raise CompressedTensorsExportError(
            f"{names[0]} and the other experts' layers are in several schemes ({labels}); transformers' "
            f"compressed-tensors loader reads every expert with one scheme, so quantize every experts projection alike"
        )
    if schemes and not next(iter(schemes)).symmetric:
        raise CompressedTensorsExportError(
            f"{names[0]} ({next(iter(schemes)).label()}) cannot be written as compressed-tensors: transformers' "
            f"compressed-tensors loader reads no zero points for experts; quantize the experts symmetric"
        )


def _loading_notes(converted: _Converted, dtype: torch.dtype, float_experts: list[str]) -> list[str]:
    """What transformers' compressed-tensors loader does differently with this checkpoint than quantlab: it decodes
    experts while loading, in their scales' dtype; `dequantize=True` decodes every other layer with one scheme. And
    how the experts left float (`float_experts`) are written."""
    notes = []
    if converted.experts_modules:
        first, count = converted.experts_modules[0], len(converted.experts_modules)
        modules = f"{first} and {count - 1} more experts modules" if count > 1 else first
        notes.append(
            f"{modules}: transformers' compressed-tensors loader decodes the experts' codes to {_dtype_name(dtype)} "
            f"weights while it loads the checkpoint, also without dequantize=True (the other layers then stay packed)"
        )
        for stored in sorted(converted.widened_scales, key=str):
            notes.append(
                f"{modules}: the experts' scales quantlab stores in {_dtype_name(stored)} are written in "
                f"{_dtype_name(dtype)}, the same numbers (transformers runs experts in their scales' dtype)"
            )
    if float_experts:
        more = f" and {len(float_experts) - 1} more" if len(float_experts) > 1 else ""
        notes.append(
            f"{float_experts[0]}{more}: experts left float are written fused (3-D), as the model holds them and "
            f"transformers loads them, not as per-expert layers"
        )
    experts = {name for family in converted.experts for name in family}
    dense = {scheme for name, scheme in converted.schemes.items() if name not in experts}
    if len(dense) > 1:
        notes.append(
            "the layers other than experts are in several schemes: load the checkpoint without "
            "CompressedTensorsConfig(dequantize=True), with which transformers decodes all of them with one scheme"
        )
    return notes


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
