"""Which tensors a GGUF file of a model holds, in which GGUF type, and whether they equal the model's.

A quantized layer whose codec maps its codes to a GGUF block type (`Codec.gguf_blocks`) is
written in that type from its own codes and scales: nothing is rounded again. Every such tensor
is decoded back (`gguf.quants.dequantize`) and compared with quantlab's dequantized weight, so
"exact" is checked, not assumed. Any other matrix (float, or codes no GGUF type holds) is
re-quantized from its float values into the fallback type: by default Q8_0 for the embedding
table and the output head and F16 for the other matrices; norms and biases are F32, as
llama.cpp's converter writes them (Gemma's norms as `1 + weight`, what llama.cpp multiplies by);
routers and GPT-2's position table stay F32, as the converter keeps them, and DeepSeek's router
brings its correction bias (`exp_probs_b`, a buffer). A float `Conv1D` (GPT-2), which stores `W`
transposed, is written as `W`; a quantized one already holds `W`'s rows.

A mixture of experts' fused projections (`QuantizedExperts`, or transformers' float experts module)
become llama.cpp's 3-D `ffn_gate_exps`, `ffn_up_exps` and `ffn_down_exps` `[experts, out, in]`:
gate and up are the two halves of `gate_up_proj`'s rows, each expert's blocks packed from its own
codes exactly as a 2-D layer's are.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from quantlab.export.gguf import architectures
from quantlab.export.gguf.architectures import Architecture
from quantlab.export.gguf.blocks import pack
from quantlab.export.gguf.errors import GGUFExportError, require_gguf
from quantlab.formats.codec import GGUFBlocks, NotExactInGGUF
from quantlab.nn import QuantizedLinear, TiedOutputHead
from quantlab.nn.kinds import is_fused_experts, is_transposed_linear, linear_weight
from quantlab.nn.quantized_embedding import QuantizedTable
from quantlab.nn.quantized_experts import QuantizedExperts

# What a matrix may be re-quantized to: the types `gguf.quants.quantize` writes that llama.cpp's CPU runs.
FALLBACK_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
TABLE_FALLBACK, MATRIX_FALLBACK = "Q8_0", "F16"
_TABLES = ("token_embd", "output")


@dataclass
class GGUFTensor:
    """One tensor of the file: its GGUF `name` and `type`, the model's `module` it comes from, its
    torch-order `shape`, the `data` written, `origin` ("codes": quantlab's codes and scales packed
    as they are; "float": the float weights; "dequantized": codes no GGUF type holds, decoded to
    float first), whether the values in the file equal the model's (`exact`) and, when not, why."""

    name: str
    module: str
    type: str
    shape: tuple[int, ...]
    origin: str
    exact: bool
    reason: str
    data: np.ndarray

    @property
    def requantized(self) -> bool:
        """A matrix whose values in the file differ from the model's (rounded into its GGUF type)."""
        return len(self.shape) >= 2 and not self.exact

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "type": self.type,
            "shape": list(self.shape),
            "origin": self.origin,
            "exact": self.exact,
            "requantized": self.requantized,
            "reason": self.reason,
        }


def model_tensors(model: nn.Module, architecture: Architecture, fallback_type: str | None) -> list[GGUFTensor]:
    """Every tensor the GGUF file of `model` holds, converted (nothing written yet)."""
    if fallback_type is not None and fallback_type not in FALLBACK_TYPES:
        raise GGUFExportError(f"fallback type {fallback_type!r} is not one of {', '.join(FALLBACK_TYPES)}")
    config = model.config
    tensors: list[GGUFTensor] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, TiedOutputHead):
            if module.bias is not None:
                raise GGUFExportError(f"{module_name}: a bias on a tied output head has no GGUF tensor")
            continue  # llama.cpp reads the embedding table as the head when `output` is absent
        quantized = isinstance(module, (QuantizedLinear, QuantizedTable))
        experts = isinstance(module, QuantizedExperts) or is_fused_experts(module)
        own = {name: p for name, p in module.named_parameters(recurse=False) if p is not None}
        if not own and not quantized and not experts:
            continue
        base = architectures.gguf_name(module_name, architecture)
        if base is None or experts != ("{}" in base):
            raise GGUFExportError(
                f"{module_name} ({type(module).__name__}) has no tensor in the GGUF {architecture.name} architecture; "
                f"merge or remove it before export"
            )
        if experts:
            tensors += expert_tensors(base, module_name, module, fallback_type or MATRIX_FALLBACK)
            continue
        matrix = _float_matrix(module, own)
        if matrix is not None and matrix.data_ptr() in seen:
            continue  # the output head tied to the float embedding table: written once
        if matrix is not None:
            seen.add(matrix.data_ptr())
        rows = getattr(module, "out_features", None) or getattr(module, "num_embeddings", None)
        rows = rows or (0 if matrix is None else matrix.shape[0])  # a Conv1D's or a router's
        order = architectures.permutation(architecture, config, base, rows)
        fallback = fallback_type or (TABLE_FALLBACK if base in _TABLES else MATRIX_FALLBACK)
        if architectures.is_float32(base):
            fallback = "F32"
        if base.endswith(architectures.VECTORS):
            values = module.dequantize_weight(torch.float32) if quantized else matrix.detach().float()
            tensors.append(_requantized(base + ".weight", module_name, values.cpu().reshape(-1), "F32", "float", ""))
        elif quantized:
            tensors.append(_quantized(base, module_name, module, order, fallback))
        elif matrix is not None:
            values = _rows(matrix.detach().float().cpu(), order)
            tensors.append(_requantized(base + ".weight", module_name, values, fallback, "float", "float in the model"))
        for name, tensor in own.items():
            if name == "weight" and matrix is not None:
                continue
            if tensor.dim() != 1:
                raise GGUFExportError(f"{module_name}.{name}: a {tensor.dim()}-D tensor here has no GGUF counterpart")
            values = _rows(tensor.detach().float().cpu(), order if name == "bias" else None)
            if name == "weight" and architecture.norm_offset and base.endswith("norm"):
                values = values + architecture.norm_offset
            tensors.append(_requantized(f"{base}.{name}", module_name, values, "F32", "float", ""))
        tensors += _buffer_tensors(base, module_name, module)
    return tensors


def _float_matrix(module: nn.Module, own: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """A float layer's `[out, in]` weight (a view): a Linear's or an embedding table's, a transposed Linear's
    (GPT-2's `Conv1D` stores `[in, out]`), or a router's own 2-D weight; None for anything else."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return module.weight
    if is_transposed_linear(module):
        return linear_weight(module.weight, transposed=True)
    if getattr(own.get("weight"), "ndim", 0) == 2:
        return own["weight"]  # a router holding its Linear weight itself
    return None


def _buffer_tensors(base: str, module_name: str, module: nn.Module) -> list[GGUFTensor]:
    """The buffers of `module` the file needs (`architectures.BUFFERS`), in F32, named within its block."""
    block = base.rpartition(".")[0]
    return [
        _requantized(
            f"{block}.{architectures.BUFFERS[name]}", module_name, buffer.detach().float().cpu(), "F32", "float", ""
        )
        for name, buffer in module.named_buffers(recurse=False)
        if name in architectures.BUFFERS
    ]


def extra_tensors(extra: dict[str, torch.Tensor]) -> list[GGUFTensor]:
    """Tensors the architecture's settings add (Llama 3's `rope_freqs`), in F32."""
    return [_requantized(name, "", values.float(), "F32", "float", "") for name, values in extra.items()]


def _quantized(base: str, module_name: str, module: Any, order: torch.Tensor | None, fallback: str) -> GGUFTensor:
    """A quantized layer's weight: its own codes in the GGUF type that holds them, when one does."""
    stored = {name: tensor.detach().cpu() for name, tensor in module.stored_tensors().items()}
    packed = _packed_codes(module.layout, stored, order)
    if packed.data is None:
        return _requantized(base + ".weight", module_name, packed.values, fallback, "dequantized", packed.reason)
    shape = tuple(packed.values.shape)
    return GGUFTensor(base + ".weight", module_name, packed.type, shape, "codes", True, "", packed.data)


@dataclass
class PackedCodes:
    """Rows of a stored matrix: quantlab's float `values`, and their codes packed in the GGUF `type` (`data`,
    checked to decode to `values`), or None and the `reason` no GGUF type holds them."""

    values: torch.Tensor
    type: str | None = None
    data: np.ndarray | None = None
    reason: str = ""


def _packed_codes(
    layout: Any, stored: dict[str, torch.Tensor], order: torch.Tensor | None = None, rows: slice = slice(None)
) -> PackedCodes:
    """The `rows` of a stored matrix (in `order`) as GGUF blocks from its own codes, decoded back and compared."""
    gguf = require_gguf()
    reference = _rows(layout.dequantize(stored, torch.float32), order)[rows]
    try:
        blocks = _row_range(_permuted(layout.codec_object.gguf_blocks(layout, stored), order), rows)
    except NotExactInGGUF as error:
        return PackedCodes(reference, reason=f"{layout.codec_object.label(layout)} {layout.bits}-bit: {error}")
    data = pack(blocks)
    decoded = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[blocks.type])
    if not np.array_equal(decoded, reference.numpy()):
        return PackedCodes(reference, reason=f"its {blocks.type} blocks decode to other values than quantlab's")
    return PackedCodes(reference, blocks.type, data)


def expert_tensors(base: str, module_name: str, module: Any, fallback: str) -> list[GGUFTensor]:
    """A mixture of experts' projections as llama.cpp's 3-D `ffn_{gate,up,down}_exps` tensors: each expert's own
    codes where a GGUF type holds them exactly (one type for all experts), else the float values rounded into
    `fallback`."""
    tensors = []
    for short, projection, half in architectures.EXPERT_PROJECTIONS:
        name = base.format(short) + ".weight"
        if isinstance(module, QuantizedExperts):
            tensors.append(_quantized_experts(name, module_name, module, projection, half, fallback))
        else:
            values = getattr(module, projection).detach().float().cpu()
            values = values[:, _half_rows(values.shape[1], half)]
            tensors.append(_requantized(name, module_name, values, fallback, "float", "float in the model"))
    return tensors


def _quantized_experts(
    name: str, module_name: str, module: QuantizedExperts, projection: str, half: int | None, fallback: str
) -> GGUFTensor:
    """One projection of every expert (`half` of `gate_up_proj`'s rows, or all of `down_proj`'s), stacked."""
    layout = module.layouts[projection]
    rows = _half_rows(layout.out_features, half)
    packed = [
        _packed_codes(layout, {key: t.detach().cpu() for key, t in expert.stored_tensors().items()}, rows=rows)
        for expert in module.slices(projection)
    ]
    values = torch.stack([p.values for p in packed])
    types = {p.type for p in packed}
    if len(types) == 1 and None not in types:
        data = np.stack([p.data for p in packed])
        return GGUFTensor(name, module_name, types.pop(), tuple(values.shape), "codes", True, "", data)
    reason = next((p.reason for p in packed if p.reason), "the experts' codes fit different GGUF types")
    return _requantized(name, module_name, values, fallback, "dequantized", reason)


def _half_rows(rows: int, half: int | None) -> slice:
    """All `rows` (half None), or the first (0) or second (1) half of them."""
    return slice(None) if half is None else slice(half * rows // 2, (half + 1) * rows // 2)


def _requantized(name: str, module_name: str, values: torch.Tensor, kind: str, origin: str, reason: str) -> GGUFTensor:
    """Float `values` rounded to the GGUF type `kind` by gguf-py; F16 when rows do not fill its blocks."""
    gguf = require_gguf()
    qtype = gguf.GGMLQuantizationType[kind]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if values.dim() >= 2 and values.shape[-1] % block:
        reason = f"{reason}; rows of {values.shape[-1]} do not fill {kind} blocks of {block}, so F16"
        kind, qtype = "F16", gguf.GGMLQuantizationType.F16
    array = values.numpy()
    data = gguf.quants.quantize(array, qtype)
    exact = bool(np.array_equal(gguf.quants.dequantize(data, qtype).reshape(array.shape), array))
    if not exact:
        reason = f"{reason}: rounded to {kind}" if reason else f"rounded to {kind}"
    return GGUFTensor(name, module_name, kind, tuple(values.shape), origin, exact, reason, data)


def _rows(values: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    return values if order is None else values.index_select(0, order)


def _permuted(blocks: GGUFBlocks, order: torch.Tensor | None) -> GGUFBlocks:
    """The blocks with their rows in `order` (codes and their scales move together: still exact)."""
    if order is None:
        return blocks
    minimum = None if blocks.min is None else _rows(blocks.min, order)
    return GGUFBlocks(blocks.type, _rows(blocks.codes, order), _rows(blocks.scale, order), minimum)


def _row_range(blocks: GGUFBlocks, rows: slice) -> GGUFBlocks:
    """The blocks of `rows` only (a row's codes and scales are its own: still exact)."""
    if rows == slice(None):
        return blocks
    minimum = None if blocks.min is None else blocks.min[rows]
    return GGUFBlocks(blocks.type, blocks.codes[rows], blocks.scale[rows], minimum)
