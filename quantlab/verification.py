"""Checking a loaded quantized checkpoint against its layers' storage layouts, so a damaged one never runs.

transformers fills a tensor missing from the file with whatever memory it had, re-initialises
one of the wrong shape, and only logs either; an edited config.json (`symmetric`, `bits`,
`scale_dtype`, `double_quant`) makes the file's tensors mean something else. So after
loading: the safetensors headers of the checkpoint (no tensor data is read) must hold every
tensor each layer's layout declares, with its shape and dtype, and nothing else under the
layer but its bias; every declared tensor must have been loaded (transformers marks those it
read `_is_hf_initialized`); and every float parameter (scales, zero points, NF4's 8-bit absmax)
must be finite. Only headers and the small parameter tensors are read, so the check is cheap
(benchmarks/RESULTS.md). The quantized vocabulary tables (`embedding_bits`) declare layouts too
and are checked the same way.
"""

import math
from pathlib import Path

import torch

from quantlab.errors import CheckpointError
from quantlab.files.safetensors_header import read_safetensors_header
from quantlab.files.shard_index import INDEX_FILE, SINGLE_FILE, read_shard_index
from quantlab.nn.quantized_linear import QuantizedLinear

_FIX = "the file is damaged or does not match its config.json: restore it, or quantize the float model again"


def verify_loaded_layer(name: str, layer: QuantizedLinear, checked_loading: bool = True) -> None:
    """Raise `CheckpointError` naming the tensor when `layer` is not what its layout declares."""
    for tensor_name, spec in layer.layout.tensors.items():
        key = f"{name}.{tensor_name}"
        tensor = getattr(layer, tensor_name, None)
        if tensor is None or (checked_loading and not getattr(tensor, "_is_hf_initialized", False)):
            raise CheckpointError(f"{key} is missing from the checkpoint; {_FIX}")
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise CheckpointError(
                f"{key} is {_describe(tensor.dtype, tuple(tensor.shape))} but its layout needs "
                f"{_describe(spec.dtype, spec.shape)}; {_FIX}"
            )
        # One reduction: the sum of float32 copies of finite scales is finite (they are far below 1e38).
        if tensor.is_floating_point() and not math.isfinite(float(tensor.sum(dtype=torch.float32))):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"{key} holds {bad} NaN/Inf value(s); {_FIX}")


def _describe(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    return f"{str(dtype).removeprefix('torch.')} {list(shape)}"


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F64": torch.float64,
    "BOOL": torch.bool,
}


def verify_checkpoint_files(directory: Path, layers: dict[str, QuantizedLinear]) -> None:
    """Compare the checkpoint's safetensors headers with every quantized layer's layout."""
    by_module: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype | None, str]]] = {}
    for key, found in _headers(directory).items():
        module, _, tensor_name = key.rpartition(".")
        by_module.setdefault(module, {})[tensor_name] = found
    if not by_module:
        return
    for name, layer in layers.items():
        stored = by_module.get(name, {})
        expected = layer.layout.tensors
        for tensor_name, spec in expected.items():
            key = f"{name}.{tensor_name}"
            if tensor_name not in stored:
                raise CheckpointError(f"{key} is missing from the checkpoint in {directory}; {_FIX}")
            shape, dtype, file = stored[tensor_name]
            if shape != spec.shape or dtype != spec.dtype:
                raise CheckpointError(
                    f"{key} in {file} is {_describe(dtype, shape)} but its layout needs "
                    f"{_describe(spec.dtype, spec.shape)}; {_FIX}"
                )
        extra = sorted(set(stored) - set(expected) - {"bias"})
        if extra:
            raise CheckpointError(
                f"{name}.{extra[0]} is in the checkpoint but not in {name}'s layout (was config.json edited?); {_FIX}"
            )


def _weight_files(directory: Path) -> list[Path]:
    """The files `from_pretrained` reads: the shards of `model.safetensors.index.json`, or `model.safetensors`."""
    index = directory / INDEX_FILE
    if index.is_file():
        return read_shard_index(index, directory).shards
    single = directory / SINGLE_FILE
    return [single] if single.is_file() else []


def _headers(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype | None, str]]:
    """Name -> (shape, dtype, file) of every tensor in the folder's safetensors files (validated headers)."""
    tensors = {}
    for file in _weight_files(Path(directory)):
        for key, entry in read_safetensors_header(file).entries.items():
            tensors[key] = (entry.shape, _SAFETENSORS_DTYPES.get(entry.dtype), file.name)
    return tensors
