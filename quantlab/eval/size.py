"""Stored size of quantized weights, in bits per weight, from a model or from its safetensors files.

"Bits per weight" counts every tensor a quantized layer stores for its weight (codes, scales,
zero points, second-level constants) against the `out * in` weights it represents; the float
bias is not counted (it is not quantized). NF4 with double quantization at block size 64
costs 4 + 8/64 + 32/(64*256) = 4.127 bits (QLoRA, arXiv 2305.14314); 3-bit groups of 64 with
float16 scale and zero point cost 3 + 32/64 = 3.5 bits.

`checkpoint_storage` reads the files themselves (names, dtypes, shapes through
`safetensors.safe_open`), so it measures what is really on disk, for quantlab checkpoints and
for other tools' (bitsandbytes) alike: a layer counts as quantized when its `weight` tensor
in the file holds integers.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantlab.errors import QuantlabError
from quantlab.nn.quantized_embedding import QuantizedTable, TiedOutputHead
from quantlab.replacement import quantized_experts, quantized_layers
from quantlab.vocabulary import find_vocabulary

# Bytes per element of the safetensors dtype names.
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_FLOAT_DTYPES = {"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"}


def stored_bits_per_weight(model: nn.Module) -> float:
    """Bits stored per weight of `model`'s quantlab quantized layers (codes + scales + zeros)."""
    layers: dict[str, Any] = {**quantized_layers(model), **quantized_experts(model)}
    if not layers:
        raise QuantlabError(f"{type(model).__name__} has no quantized layer; quantize it first (quantlab.quantize)")
    stored = sum(layer.stored_bytes() for layer in layers.values())
    weights = sum(layer.in_features * layer.out_features for layer in layers.values())
    return stored * 8 / weights


@dataclass
class CheckpointStorage:
    """What a checkpoint's safetensors files hold, split into quantized layers and the rest."""

    quantized_bytes: int = 0
    quantized_weights: int = 0
    other_bytes: int = 0
    file_bytes: int = 0
    layers: dict[str, int] = field(default_factory=dict)  # quantized layer -> stored bytes

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight of the quantized layers."""
        if not self.quantized_weights:
            raise QuantlabError("the checkpoint has no quantized layer (no Linear weight stored as integers)")
        return self.quantized_bytes * 8 / self.quantized_weights


def checkpoint_bits_per_weight(directory: str | os.PathLike, model: nn.Module | None = None) -> float:
    """Stored bits per quantized weight, measured from the safetensors file(s) in `directory`."""
    return checkpoint_storage(directory, model).bits_per_weight


def checkpoint_storage(directory: str | os.PathLike, model: nn.Module | None = None) -> CheckpointStorage:
    """Measure a saved checkpoint from its safetensors files.

    The `[out, in]` shape of each layer comes from `model` when given (any module whose
    layers have `in_features`/`out_features` under the names of the file), otherwise from
    the architecture in `config.json`, built on the meta device (no memory, no weights).
    """
    directory = Path(directory)
    files = safetensors_files(directory)
    tensors = _tensor_sizes(files)
    if model is None:
        model = _meta_model(directory)
        shapes = _linear_shapes(model, skip=_vocabulary_head(model, directory))
    else:
        shapes = _linear_shapes(model)
    storage = CheckpointStorage(file_bytes=sum(f.stat().st_size for f in files))
    counted: set[str] = set()
    for layer, (out_features, in_features) in shapes.items():
        prefix = f"{layer}." if layer else ""
        weight = tensors.get(prefix + "weight")
        if weight is None or weight[1] in _FLOAT_DTYPES:
            continue
        names = [n for n in tensors if n.startswith(prefix) and _belongs_to_weight(n[len(prefix) :])]
        layer_bytes = sum(tensors[n][0] for n in names)
        storage.layers[layer] = layer_bytes
        storage.quantized_bytes += layer_bytes
        storage.quantized_weights += out_features * in_features
        counted.update(names)
    storage.other_bytes = sum(size for name, (size, _) in tensors.items() if name not in counted)
    return storage


def safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise QuantlabError(f"no .safetensors file in {directory}; point at a folder written by save_pretrained")
    return files


def _belongs_to_weight(suffix: str) -> bool:
    """A stored tensor of the layer's weight: everything but the float bias (and its own state)."""
    return suffix != "bias" and not suffix.startswith("bias.")


def _tensor_sizes(files: list[Path]) -> dict[str, tuple[int, str]]:
    """Tensor name -> (bytes, safetensors dtype) for every tensor in the files."""
    from safetensors import safe_open

    sizes = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  (safe_open handles are not iterable)
                tensor = handle.get_slice(name)
                dtype = tensor.get_dtype()
                if dtype not in _DTYPE_BYTES:
                    raise QuantlabError(f"{path.name}: tensor {name} has dtype {dtype}, unknown to quantlab.eval.size")
                count = 1
                for dim in tensor.get_shape():
                    count *= dim
                sizes[name] = (count * _DTYPE_BYTES[dtype], dtype)
    return sizes


def _linear_shapes(model: nn.Module, skip: set[str] = frozenset()) -> dict[str, tuple[int, int]]:
    """Layer name -> (out, in) of every module with `in_features` and `out_features`, less the
    vocabulary tables (`embedding_bits`), which are not quantized Linear layers."""
    shapes = {}
    for name, module in model.named_modules():
        if name in skip or isinstance(module, (QuantizedTable, TiedOutputHead)):
            continue
        out_features = getattr(module, "out_features", None)
        in_features = getattr(module, "in_features", None)
        if isinstance(out_features, int) and isinstance(in_features, int):
            shapes[name] = (out_features, in_features)
    return shapes


def _vocabulary_head(model: nn.Module, directory: Path) -> set[str]:
    """The output head's name when the checkpoint stores it as a vocabulary table (`embedding_bits`)."""
    quantization = json.loads((directory / "config.json").read_text()).get("quantization_config") or {}
    if quantization.get("embedding_bits") is None:
        return set()
    head = find_vocabulary(model).head
    return {head} if head is not None else set()


def _meta_model(directory: Path) -> nn.Module:
    import transformers

    config_path = directory / "config.json"
    if not config_path.is_file():
        raise QuantlabError(f"no config.json in {directory}; pass model= to give the layer shapes")
    architectures = json.loads(config_path.read_text()).get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None:
        raise QuantlabError(
            f"{config_path} names no architecture transformers knows ({architectures}); pass model= to give the "
            f"layer shapes"
        )
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        return model_class(config)
