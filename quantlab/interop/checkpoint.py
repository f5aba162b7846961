"""A compressed-tensors, GPTQ or AWQ checkpoint folder rewritten as a quantlab checkpoint, codes and scales unchanged.

Every quantized layer becomes a layer of quantlab's `custom_bits` method (or `int8`, when all of
them are symmetric 8-bit) whose layout holds the source's integer grid exactly
(`Codec.from_integer_grid`): same codes, same scales in their dtype, the same whole zero points.
Layers with other schemes than the most common one get `layer_options`; float layers are listed in
`modules_to_not_convert`. Tensors are converted one layer at a time, shard by shard; the tokenizer
and other files are copied.

A mixture of experts stored one Linear layer per expert and projection (`experts.3.gate_proj`) keeps
those names: transformers merges them into the model's fused projections while loading, the codes as
its conversion mapping says and the other stored tensors alike (`quantlab.integrations.transformers`).
The config names their options by the fused projection (`quantlab.interop.experts`), which holds one
scheme; experts modules stored in float are listed in `modules_to_not_convert`.
"""

import json
import shutil
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantlab.config import QuantlabConfig
from quantlab.formats.codec import IntegerGrid, NotAnIntegerGrid
from quantlab.interop import awq, gptq
from quantlab.interop import compressed_tensors as ct
from quantlab.interop.errors import ForeignCheckpointError
from quantlab.interop.experts import ModelNames, model_names
from quantlab.methods.custom_bits import CustomBitsConfig, CustomBitsLinear
from quantlab.methods.int8 import Int8Linear, Int8SymmetricConfig
from quantlab.nn.quantized_experts import PROJECTIONS

INDEX = "model.safetensors.index.json"
_NOT_COPIED = {"config.json", INDEX, "quantize_config.json", "quant_config.json"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class _Header:
    file: Path
    dtype: str
    shape: tuple[int, ...]


class _Reader:
    """One source format: which stored layers are quantized, their scheme, and their integer grid."""

    tensor_names: tuple[str, ...]
    scale_name: str

    def is_layer(self, names: dict[str, _Header]) -> bool:
        raise NotImplementedError

    def scheme(self, layer: str) -> ct.Scheme:
        raise NotImplementedError

    def grid(self, layer: str, tensors: dict[str, torch.Tensor]) -> IntegerGrid:
        raise NotImplementedError


class _CompressedTensors(_Reader):
    tensor_names = ct.LAYER_TENSORS
    scale_name = ct.SCALE

    def __init__(self, config: dict[str, Any]) -> None:
        self.groups, self.ignore = ct.read_config(config)
        if any(group.dynamic_activations for group in self.groups):
            warnings.warn(
                "the checkpoint quantizes activations on the fly (dynamic input_activations); quantlab reads its "
                "weights exactly and runs the activations in float",
                stacklevel=4,
            )

    def is_layer(self, names: dict[str, _Header]) -> bool:
        plain = names.get(ct.PLAIN)
        return ct.PACKED in names or (plain is not None and plain.dtype in ("I8", "I32") and ct.SCALE in names)

    def scheme(self, layer: str) -> ct.Scheme:
        return ct.group_of(layer, self.groups).scheme

    def grid(self, layer: str, tensors: dict[str, torch.Tensor]) -> IntegerGrid:
        group = ct.group_of(layer, self.groups)
        return ct.read_layer(tensors, group.scheme, group.strategy, layer)


class _GPTQ(_Reader):
    tensor_names = gptq.LAYER_TENSORS
    scale_name = gptq.SCALES

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = gptq.GPTQConfig.read(config)

    def is_layer(self, names: dict[str, _Header]) -> bool:
        return gptq.QWEIGHT in names

    def scheme(self, layer: str) -> ct.Scheme:
        return self.config.scheme

    def grid(self, layer: str, tensors: dict[str, torch.Tensor]) -> IntegerGrid:
        return gptq.read_layer(tensors, self.config, layer)


class _AWQ(_Reader):
    tensor_names = awq.LAYER_TENSORS
    scale_name = awq.SCALES

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = awq.AWQConfig.read(config)

    def is_layer(self, names: dict[str, _Header]) -> bool:
        return awq.QWEIGHT in names

    def scheme(self, layer: str) -> ct.Scheme:
        return self.config.scheme

    def grid(self, layer: str, tensors: dict[str, torch.Tensor]) -> IntegerGrid:
        return awq.read_layer(tensors, self.config, layer)


_READERS: dict[str, type[_Reader]] = {
    ct.QUANT_METHOD: _CompressedTensors,
    gptq.QUANT_METHOD: _GPTQ,
    awq.QUANT_METHOD: _AWQ,
}


def convert_checkpoint(source: Path, target: Path) -> QuantlabConfig:
    """Write the quantlab checkpoint of the compressed-tensors, GPTQ or AWQ checkpoint `source` into the empty
    folder `target`; returns its quantization config. ForeignCheckpointError, naming the layer, otherwise."""
    config = json.loads((source / "config.json").read_text())
    quantization = config.get("quantization_config") or {}
    reader = _READERS[quantization.get("quant_method")](quantization)
    headers = _headers(source)
    layers = _layers(headers, reader)
    if not layers:
        raise ForeignCheckpointError(f"{source} says {quantization.get('quant_method')} but stores no quantized layer")
    names = model_names(source, _float_keys(headers, layers), layers)
    quantlab_config, module_class = _quantlab_config(headers, layers, reader, names)
    with ExitStack() as files:
        opened: dict[Path, Any] = {}
        for shard in sorted({header.file for header in headers.values()}):
            target_layouts = _Layouts(quantlab_config, module_class, names)
            tensors = dict(_converted(shard, headers, layers, reader, target_layouts, opened, files))
            _save(tensors, target / shard.name)
    _write_index(target)
    config["quantization_config"] = quantlab_config.to_dict()
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for file in source.iterdir():
        if file.is_file() and file.name not in _NOT_COPIED and file.suffix not in _WEIGHT_SUFFIXES:
            shutil.copy2(file, target / file.name)
    return quantlab_config


def _headers(source: Path) -> dict[str, _Header]:
    """Name → file, dtype and shape of every stored tensor (headers only, no data read)."""
    from safetensors import safe_open

    files = sorted(source.glob("*.safetensors"))
    if not files:
        others = sorted(file.name for file in source.iterdir() if file.suffix in _WEIGHT_SUFFIXES)
        raise ForeignCheckpointError(
            f"{source} stores its weights in {', '.join(others) or 'no file'}; quantlab reads quantized checkpoints "
            f"from .safetensors files"
        )
    headers = {}
    for file in files:
        with safe_open(file, "pt") as handle:
            names = handle.keys()  # a safe_open handle is no mapping: `in handle` does not iterate it
            for key in names:
                piece = handle.get_slice(key)
                headers[key] = _Header(file, piece.get_dtype(), tuple(piece.get_shape()))
    return headers


def _layers(headers: dict[str, _Header], reader: _Reader) -> dict[str, dict[str, _Header]]:
    """Quantized layer name → its stored tensors (name within the layer → header)."""
    by_module: dict[str, dict[str, _Header]] = {}
    for key, header in headers.items():
        module, _, name = key.rpartition(".")
        if name in reader.tensor_names:
            by_module.setdefault(module, {})[name] = header
    return {module: names for module, names in by_module.items() if reader.is_layer(names)}


_SAFETENSORS_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _float_keys(headers: dict[str, _Header], layers: dict[str, dict[str, _Header]]) -> list[str]:
    """The stored tensors that belong to no quantized layer."""
    return [key for key in headers if key.rpartition(".")[0] not in layers]


def _quantlab_config(
    headers: dict[str, _Header], layers: dict[str, dict[str, _Header]], reader: _Reader, names: ModelNames
) -> tuple[QuantlabConfig, type]:
    """The quantlab config whose layouts hold every layer's scheme: int8 when all are symmetric 8-bit, else
    custom_bits with the most common options and `layer_options` for the others. Layers are named as the model
    names them: per-expert layers by the fused experts projection they are merged into, which holds one scheme."""
    options: dict[str, dict[str, Any]] = {}
    for layer, stored in layers.items():
        found = _options(layer, stored, reader)
        name = names.layer(layer)
        if options.setdefault(name, found) != found:
            raise ForeignCheckpointError(
                f"{layer} ({_label(found)}) is merged into {name} with experts' layers in {_label(options[name])}; "
                f"quantlab stores a fused experts projection in one scheme: quantize the float model with quantlab"
            )
    floats = _float_modules(headers, _float_keys(headers, layers), names) | _float_experts(layers, headers, names)
    if all(o["bits"] == 8 and o["symmetric"] for o in options.values()):
        shared = {(o["group_size"], o["scale_dtype"]) for o in options.values()}
        if len(shared) == 1:
            group_size, scale_dtype = shared.pop()
            config = _config(Int8SymmetricConfig, sorted(floats), group_size=group_size, scale_dtype=scale_dtype)
            return config, Int8Linear
    common = Counter(tuple(o.items()) for o in options.values()).most_common(1)[0][0]
    overrides = {layer: o for layer, o in options.items() if tuple(o.items()) != common}
    config = _config(CustomBitsConfig, sorted(floats), **dict(common), layer_options=overrides or None)
    return config, CustomBitsLinear


def _options(layer: str, stored: dict[str, _Header], reader: _Reader) -> dict[str, Any]:
    """The quantlab options of one stored layer's scheme (its scales' dtype included)."""
    scheme = reader.scheme(layer)
    scale = stored.get(reader.scale_name)
    scale_dtype = _SAFETENSORS_FLOATS.get(scale.dtype) if scale is not None else None
    if scale_dtype is None:
        found = scale.dtype if scale is not None else "none"
        raise ForeignCheckpointError(f"{layer}: scales stored as {found}; quantlab reads float32/float16/bfloat16")
    return {
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "symmetric": scheme.symmetric,
        "scale_dtype": scale_dtype,
    }


def _label(options: dict[str, Any]) -> str:
    grouping = "per channel" if options["group_size"] is None else f"g{options['group_size']}"
    symmetric = "sym" if options["symmetric"] else "asym"
    return f"int{options['bits']} {grouping} {symmetric}, {options['scale_dtype']} scales"


def _float_modules(headers: dict[str, _Header], float_keys: list[str], names: ModelNames) -> set[str]:
    """The float Linear layers (2-D `.weight`, experts' aside) under the model's names."""
    return {
        names.layer(key.rpartition(".")[0])
        for key in float_keys
        if key.endswith(".weight") and len(headers[key].shape) == 2 and key.removesuffix(".weight") not in names.experts
    }


def _float_experts(layers: dict[str, Any], headers: dict[str, _Header], names: ModelNames) -> set[str]:
    """The model's fused experts modules the checkpoint stores in float (quantlab keeps them float); refuses a
    module stored partly quantized, or not at all under the names transformers loads it from."""
    quantized: dict[str, set[str]] = {}
    for layer in layers:
        if layer in names.experts:
            module, _, projection = names.experts[layer].rpartition(".")
            quantized.setdefault(module, set()).add(projection)
    stored_float = [key.removesuffix(".weight") for key in _float_keys(headers, layers)]
    floats = {names.experts[key].rpartition(".")[0] for key in stored_float if key in names.experts}
    for module in names.modules:
        stored = quantized.get(module, set())
        if stored and (module in floats or stored != set(PROJECTIONS)):
            raise ForeignCheckpointError(
                f"{module}: the checkpoint stores some of its experts' weights quantized and others in float; "
                f"quantlab holds an experts module all quantized or all float: quantize the float model with quantlab"
            )
        if not stored and module not in floats:
            raise ForeignCheckpointError(
                f"{module}: the checkpoint stores none of its experts' weights under the names transformers loads them "
                f"from; load it with transformers and compressed-tensors, or quantize the float model with quantlab"
            )
    return floats


def _config(cls: type[QuantlabConfig], floats: list[str], **options: Any) -> QuantlabConfig:
    from quantlab.errors import ConfigError

    try:
        return cls(modules_to_not_convert=floats, **options)
    except ConfigError as error:
        raise ForeignCheckpointError(f"the checkpoint's scheme has no quantlab layout: {error}") from None


def _converted(
    shard: Path,
    headers: dict[str, _Header],
    layers: dict[str, dict[str, _Header]],
    reader: _Reader,
    layouts: "_Layouts",
    opened: dict[Path, Any],
    files: ExitStack,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The quantlab tensors of one shard: each quantized layer (once, with its first tensor) and the rest as is."""
    done = set()
    for key, header in headers.items():
        if header.file != shard:
            continue
        module, _, name = key.rpartition(".")
        if module not in layers or name not in reader.tensor_names:
            yield key, _read(key, header, opened, files)
            continue
        if module in done:
            continue
        done.add(module)
        stored = {name: _read(f"{module}.{name}", h, opened, files) for name, h in layers[module].items()}
        grid = reader.grid(module, stored)
        out, cols = grid.codes.shape
        layout = layouts.of(module, out, cols)
        try:
            tensors = layout.codec_object.from_integer_grid(layout, grid)
        except NotAnIntegerGrid as error:
            raise ForeignCheckpointError(f"{module}: {error}") from None
        for tensor_name, tensor in tensors.items():
            yield f"{module}.{tensor_name}", tensor


@dataclass(frozen=True)
class _Layouts:
    """The quantlab layout of each stored layer: its config's options are under the model's name for it."""

    config: QuantlabConfig
    module_class: type
    names: ModelNames

    def of(self, layer: str, out: int, cols: int) -> Any:
        return self.module_class.layout_for(cols, out, self.config.config_for(self.names.layer(layer)))


def _read(key: str, header: _Header, opened: dict[Path, Any], files: ExitStack) -> torch.Tensor:
    from safetensors import safe_open

    if header.file not in opened:
        opened[header.file] = files.enter_context(safe_open(header.file, "pt"))
    return opened[header.file].get_tensor(key)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({key: tensor.contiguous() for key, tensor in tensors.items()}, path, metadata={"format": "pt"})


def _write_index(folder: Path) -> None:
    """The index of a sharded checkpoint (the shards keep their names; what each holds is read back)."""
    from safetensors import safe_open

    shards = sorted(folder.glob("*.safetensors"))
    if len(shards) < 2:
        return
    weight_map, total = {}, 0
    for shard in shards:
        with safe_open(shard, "pt") as handle:
            weight_map.update(dict.fromkeys(handle.keys(), shard.name))
        total += shard.stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
