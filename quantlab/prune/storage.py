"""Sparse checkpoints: pruned weights stored as a bitmask plus the live values, so size falls with sparsity.

`save_sparse(model, dir)` writes what `save_pretrained` writes (config, generation config,
quantization config) but replaces the weight files by one `model.sparse.safetensors` in which
every tensor that is smaller that way is stored as
- float weights: `<name>.sparse_bitmask` (1 bit per weight, set where the weight is non-zero)
  and `<name>.sparse_values` (the non-zero weights, in row-major order, in their dtype): at
  50 % sparsity a float32 matrix costs 16 + 1 = 17 bits per weight, 0.53x; bfloat16 0.56x.
  N:M sparsity uses the same layout: for 2:4 it costs exactly what the 2:4 compressed layout
  of sparse tensor cores costs (values plus 2-bit indices of the 2 kept weights of each 4,
  i.e. 1 bit per weight), and for 4:8 less (the 3-bit indices would cost 1.5 bits per weight);
- quantized weights (pruned, then quantized with any quantlab method: the codes are read through
  the layer's storage layout, `quantlab.prune.codes`): the bitmask of live weights, their codes
  packed at the layout's bit width (`<name>.sparse_codes`), and one code per group that every
  pruned weight of the group shares (`<name>.sparse_fill`), so reloading rebuilds the codes bit
  for bit. Int8, NF4 and symmetric integer formats represent zero exactly, so pruned weights
  stay exactly zero; an asymmetric format with a float zero point does not, its pruned weights
  dequantize to small non-zero values, and such layers are stored dense.
Everything else (embeddings, norms, dense layers, scales) is stored as is. The file's metadata
lists the encoded tensors (`quantlab_sparse`: format version, shapes, dtypes, layouts).

`load_sparse(dir)` decodes the file into the state dict `save_pretrained` would have written
and hands it to `from_pretrained(None, config=..., state_dict=...)`, so loading takes the
usual path (tied weights, dtype, quantized layers on the pre-quantized path); float layers
get their masks back (`quantlab.prune.layer_masks`), ready for `KeepMasks` during fine-tuning.
`load_sparse(dir, quantization_config=quantlab.NF4Config())` quantizes while loading, and
`save_sparse` of the result writes a sparse and quantized checkpoint.

The weight file has a name `from_pretrained` does not look for: a process without quantlab
fails with "no file named model.safetensors" instead of loading a model with missing weights.
"""

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from quantlab.errors import QuantlabError
from quantlab.formats import fast_path, grouping, packing
from quantlab.nn import QuantizedLinear
from quantlab.prune.bitmask import pack_bits, unpack_bits
from quantlab.prune.codes import CodeLayout, code_layout
from quantlab.prune.layer_masks import attach_mask
from quantlab.utils.atomic import atomic_directory

SPARSE_WEIGHTS_FILE = "model.sparse.safetensors"
METADATA_KEY = "quantlab_sparse"
FORMAT_VERSION = 1
_DENSE_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


@dataclasses.dataclass(frozen=True)
class TensorStorage:
    """One encoded tensor: what it would take dense, what it takes, and its fraction of zeros."""

    kind: str  # "linear" (a float Linear weight), "quantized" (a quantized layer's codes), "tensor"
    dense_bytes: int
    stored_bytes: int
    sparsity: float


@dataclasses.dataclass
class SparseStorage:
    """The storage of a sparse checkpoint, from its file: sizes and the ratio that matters."""

    file_bytes: int
    dense_bytes: int  # every tensor of the file, decoded
    tensors: dict[str, TensorStorage]

    def ratio(self, kinds: tuple[str, ...] = ("linear", "quantized")) -> float:
        """Stored / dense bytes of the encoded tensors of `kinds` (the pruned layers' weights)."""
        chosen = [t for t in self.tensors.values() if t.kind in kinds]
        dense = sum(t.dense_bytes for t in chosen)
        if not dense:
            raise QuantlabError("the checkpoint stores no pruned weight compactly (nothing was sparse enough)")
        return sum(t.stored_bytes for t in chosen) / dense


# -- saving -------------------------------------------------------------------------------------


def save_sparse(
    model: nn.Module,
    directory: str | os.PathLike,
    tokenizer: Any = None,
    overwrite: bool = False,
    protect: Iterable[str | os.PathLike] = (),
) -> Path:
    """Save `model` like `save_pretrained`, storing its sparse weights compactly; returns the folder.

    Written atomically: the folder appears complete or not at all; `overwrite` never deletes a
    `protect`ed input (see `quantlab.utils.atomic`).
    """
    if hasattr(model, "peft_config"):
        raise QuantlabError(
            "save_sparse saves a whole model, and PEFT models save only their adapters: merge the adapters "
            "(quantlab.training.merge_adapter) or save the base model"
        )
    if not hasattr(model, "save_pretrained"):
        raise QuantlabError(f"{type(model).__name__} has no save_pretrained; save_sparse needs a transformers model")
    directory = Path(directory)
    with atomic_directory(directory, overwrite=overwrite, protect=protect) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        tensors = _read_and_remove_weight_files(staging)
        stored, entries = encode_state_dict(tensors, dict(model.named_modules()))
        metadata = {"format": "pt", METADATA_KEY: json.dumps({"format_version": FORMAT_VERSION, "tensors": entries})}
        save_file(stored, str(staging / SPARSE_WEIGHTS_FILE), metadata=metadata)
    return directory


def encode_state_dict(
    tensors: dict[str, torch.Tensor], modules: dict[str, nn.Module]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Replace each tensor that is smaller encoded by its encoded parts; returns them and their descriptions."""
    stored: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        module = modules.get(prefix)
        encoded = None
        if leaf == "weight" and isinstance(module, QuantizedLinear):
            encoded = _encode_codes(tensor, module)
        elif tensor.is_floating_point() and tensor.dim() >= 2:
            kind = "linear" if leaf == "weight" and isinstance(module, nn.Linear) else "tensor"
            encoded = _encode_values(tensor, kind)
        if encoded is None or _bytes(encoded[0]) >= _bytes({name: tensor}):
            stored[name] = tensor.contiguous()
            continue
        parts, entry = encoded
        stored.update({f"{name}.{suffix}": part.contiguous() for suffix, part in parts.items()})
        entries[name] = entry
    return stored, entries


def _encode_values(tensor: torch.Tensor, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    live = tensor != 0
    parts = {"sparse_bitmask": pack_bits(live), "sparse_values": tensor[live]}
    return parts, {"encoding": "bitmask", "kind": kind, **_describe(tensor), "live": int(live.sum())}


def _encode_codes(stored: torch.Tensor, layer: QuantizedLinear) -> tuple[dict[str, torch.Tensor], dict] | None:
    layout = code_layout(layer)
    if layout is None:
        return None
    codes = layout.unpack(stored)
    live = grouping.group(layer.dequantize_weight(torch.float32), layout.group_size) != 0
    if live.shape != codes.shape:
        return None
    fill = _shared_fill_codes(codes, ~live)
    if fill is None:
        return None
    kept = codes[live]
    parts = {
        "sparse_bitmask": pack_bits(live),
        "sparse_codes": fast_path.pack(kept.reshape(1, -1), layout.bits).reshape(-1),
        "sparse_fill": fill,
    }
    entry = {"encoding": "codes", "kind": "quantized", **_describe(stored), "live": int(kept.numel())}
    return parts, {**entry, "layout": layout.to_json(), "codes_shape": list(codes.shape)}


def _shared_fill_codes(codes: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor | None:
    """The one code the pruned weights of each group share, or None if some group's differ."""
    wide = codes.to(torch.int16)
    low = torch.where(pruned, wide, 256).amin(-1)
    high = torch.where(pruned, wide, -1).amax(-1)
    present = pruned.any(-1)
    if bool((present & (low != high)).any()):
        return None
    return torch.where(present, low, 0).to(torch.uint8)


# -- loading ------------------------------------------------------------------------------------


def is_sparse_checkpoint(directory: str | os.PathLike) -> bool:
    return (Path(directory) / SPARSE_WEIGHTS_FILE).is_file()


def load_sparse(directory: str | os.PathLike, masks: bool = True, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a checkpoint written by `save_sparse` (or a normal one), as `from_pretrained` would.

    `masks`: give float layers stored sparse their pruning masks back (the live-weight
    bitmask), so fine-tuning with `KeepMasks` holds the sparsity. Keyword arguments go to
    `from_pretrained` (`dtype=...`, for instance).
    """
    from transformers import AutoConfig

    directory = Path(directory)
    model_class = _model_class(directory)
    if not is_sparse_checkpoint(directory):
        return model_class.from_pretrained(directory, local_files_only=True, **from_pretrained_kwargs)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    state_dict, live = read_sparse_state_dict(directory)
    model = model_class.from_pretrained(None, config=config, state_dict=state_dict, **from_pretrained_kwargs)
    _load_generation_config(model, directory)
    if masks:
        modules = dict(model.named_modules())
        for name, mask in live.items():
            layer = modules.get(name.rpartition(".")[0])
            if type(layer) is nn.Linear and layer.weight.shape == mask.shape:
                attach_mask(layer, mask)
    return model.eval()


def read_sparse_state_dict(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The dense state dict of a sparse checkpoint, and the live-weight masks of its float Linear weights."""
    path = Path(directory) / SPARSE_WEIGHTS_FILE
    entries = _entries(path)
    stored = load_file(str(path))
    state_dict = {name: tensor for name, tensor in stored.items() if not _is_part(name, entries)}
    live: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        parts = {suffix: stored[f"{name}.{suffix}"] for suffix in _PARTS[entry["encoding"]]}
        if entry["encoding"] == "bitmask":
            state_dict[name], mask = _decode_values(parts, entry)
            if entry["kind"] == "linear":
                live[name] = mask
        else:
            state_dict[name] = _decode_codes(parts, entry)
    return state_dict, live


def sparse_storage(directory: str | os.PathLike) -> SparseStorage:
    """Sizes of a sparse checkpoint's tensors, encoded and dense, read from its file's header."""
    path = Path(directory) / SPARSE_WEIGHTS_FILE
    if not path.is_file():
        raise QuantlabError(
            f"{directory} is not a sparse checkpoint (no {SPARSE_WEIGHTS_FILE}); write one with save_sparse"
        )
    entries = _entries(path)
    sizes: dict[str, int] = {}
    with safe_open(path, framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118  (safe_open handles are not iterable)
            piece = handle.get_slice(name)
            sizes[name] = _numel(piece.get_shape()) * _DTYPE_SIZES[piece.get_dtype()]
    tensors = {}
    for name, entry in entries.items():
        dense = _numel(entry["shape"]) * torch.empty((), dtype=_dtype(entry["dtype"])).element_size()
        stored = sum(sizes[f"{name}.{suffix}"] for suffix in _PARTS[entry["encoding"]])
        tensors[name] = TensorStorage(entry["kind"], dense, stored, 1 - entry["live"] / max(1, _live_total(entry)))
    plain = sum(size for name, size in sizes.items() if not _is_part(name, entries))
    dense_total = plain + sum(t.dense_bytes for t in tensors.values())
    return SparseStorage(file_bytes=path.stat().st_size, dense_bytes=dense_total, tensors=tensors)


# -- helpers ------------------------------------------------------------------------------------

_PARTS = {"bitmask": ("sparse_bitmask", "sparse_values"), "codes": ("sparse_bitmask", "sparse_codes", "sparse_fill")}
_DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F16": 2, "BF16": 2, "I16": 2, "U16": 2, "F32": 4, "I32": 4, "U32": 4}
_DTYPE_SIZES.update({"F64": 8, "I64": 8, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1})


def _decode_values(parts: dict[str, torch.Tensor], entry: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    shape = entry["shape"]
    mask = unpack_bits(parts["sparse_bitmask"], _numel(shape))
    values = parts["sparse_values"]
    if int(mask.sum()) != values.numel():
        raise QuantlabError(f"corrupt sparse checkpoint: {values.numel()} values for {int(mask.sum())} set mask bits")
    dense = torch.zeros(mask.numel(), dtype=values.dtype)
    dense[mask] = values
    return dense.view(shape), mask.view(shape)


def _decode_codes(parts: dict[str, torch.Tensor], entry: dict[str, Any]) -> torch.Tensor:
    layout = CodeLayout(**entry["layout"])
    codes_shape = entry["codes_shape"]
    live = unpack_bits(parts["sparse_bitmask"], _numel(codes_shape)).view(codes_shape)
    codes = parts["sparse_fill"].unsqueeze(-1).expand(codes_shape).clone()
    count = int(live.sum())
    codes[live] = packing.unpack(parts["sparse_codes"].reshape(1, -1), layout.bits, count).reshape(-1)
    weight = layout.pack(codes)
    if list(weight.shape) != entry["shape"]:
        raise QuantlabError(f"corrupt sparse checkpoint: codes rebuild to {list(weight.shape)}, not {entry['shape']}")
    return weight


def _describe(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _live_total(entry: dict[str, Any]) -> int:
    return _numel(entry["codes_shape"] if entry["encoding"] == "codes" else entry["shape"])


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _is_part(name: str, entries: dict[str, Any]) -> bool:
    prefix, _, suffix = name.rpartition(".")
    return prefix in entries and suffix.startswith("sparse_")


def _entries(path: Path) -> dict[str, dict[str, Any]]:
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata() or {}
    if METADATA_KEY not in metadata:
        raise QuantlabError(f"{path} has no {METADATA_KEY!r} metadata; it was not written by quantlab's save_sparse")
    described = json.loads(metadata[METADATA_KEY])
    version = int(described.get("format_version", 0))
    if version > FORMAT_VERSION:
        raise QuantlabError(
            f"{path} uses sparse format version {version}; this quantlab reads up to {FORMAT_VERSION}: upgrade quantlab"
        )
    return described["tensors"]


def _read_and_remove_weight_files(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for pattern in _DENSE_WEIGHT_FILES:
        for path in folder.glob(pattern):
            if path.name.endswith(".safetensors"):
                tensors.update(load_file(str(path)))
            elif path.suffix == ".bin":
                raise QuantlabError(f"{path.name}: save_sparse needs safetensors weights (safe_serialization)")
            path.unlink()
    if not tensors:
        raise QuantlabError(f"save_pretrained wrote no safetensors weights into {folder}")
    return tensors


def _model_class(directory: Path) -> type:
    import transformers

    config_path = directory / "config.json"
    if not config_path.is_file():
        raise QuantlabError(f"{directory} is not a model folder: it has no config.json")
    for name in json.loads(config_path.read_text()).get("architectures") or []:
        found = getattr(transformers, name, None)
        if isinstance(found, type):
            return found
    return transformers.AutoModelForCausalLM


def _load_generation_config(model: nn.Module, directory: Path) -> None:
    if (directory / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
