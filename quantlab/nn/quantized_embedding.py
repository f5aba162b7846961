"""Quantized vocabulary tables: the input embedding and the output head stored in a few bits.

A `[vocab, hidden]` table is stored like a Linear weight `[out, in]`, one output channel per
token (`StorageLayout` with `in_features = hidden`), so the kernel table computes logits from
it and load verification reads its layout like any layer's. A lookup decodes only the rows
it gathers. A head tied to the embeddings (`TiedOutputHead`) holds no tensor of its own: it
multiplies by the embedding's stored codes, so a checkpoint holds the table once (sizes in
benchmarks/RESULTS.md). An untied head (`QuantizedOutputHead`) stores
its own table in the same layout.

These are deliberately not `QuantizedLinear`s: the bits per weight quantlab reports for the
quantized Linear layers leave them out, LoRA does not wrap them, and nothing here trains.
Which width and group size: `QuantlabConfig.embedding_bits` / `embedding_group_size`.
"""

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from quantlab.config import QuantlabConfig
from quantlab.errors import QuantizationError
from quantlab.formats import grouping, int8
from quantlab.formats.affine import AFFINE
from quantlab.formats.int8 import INT8
from quantlab.formats.layout import StorageLayout
from quantlab.kernels import select_kernel
from quantlab.nn.quantized_linear import StorageSpec
from quantlab.nn.stored import StoredTensorsModule

SCALE_DTYPE = torch.float16


def vocabulary_layout(rows: int, width: int, config: QuantlabConfig) -> StorageLayout:
    """The layout of a `[rows, width]` table under `config.embedding_bits`: the int8 codec at 8 bits,
    symmetric affine codes (the affine codec's default options) below, one float16 scale per
    `embedding_group_size` weights of a row."""
    bits, group_size = config.embedding_bits, config.embedding_group_size
    if bits is None:
        raise QuantizationError(f"{config.method}: embedding_bits is None, so the embedding table stays in float")
    codec = INT8 if bits == int8.BITS else AFFINE
    return StorageLayout(codec.name, bits, group_size, width, rows, scale_dtype=SCALE_DTYPE)


def unpack_arithmetic(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """`quantlab.formats.packing.unpack` in float arithmetic, without bit shifts (which ONNX lacks for
    signed integers) and on numbers below 2**16 (exact in float32, where ONNX runs integer division).

    Code `i` of a chunk of eight starts at bit `bits * i`: it lies in the byte pair starting at
    byte `bits * i // 8`, shifted by `bits * i % 8`.
    """
    *lead, nbytes = packed.shape
    chunks = packed.reshape(*lead, nbytes // bits, bits).float()
    chunks = torch.cat([chunks, torch.zeros_like(chunks[..., :1])], dim=-1)  # the pair of the last byte
    first = torch.tensor([bits * i // 8 for i in range(8)], device=packed.device)
    shift = torch.tensor([float(1 << (bits * i % 8)) for i in range(8)], device=packed.device)
    pairs = chunks.index_select(-1, first) + 256 * chunks.index_select(-1, first + 1)
    codes = torch.remainder(torch.floor(pairs / shift), float(1 << bits))
    return codes.to(torch.uint8).reshape(*lead, nbytes // bits * 8)[..., :length]


class QuantizedTable(StoredTensorsModule):
    """A `[rows, width]` float table stored in a `StorageLayout` (every stored tensor is a buffer).

    It answers the same questions a `QuantizedLinear` does (`layout`, `stored_tensors`,
    `dequantize_weight`, `bias`), so kernels, loaders and load checks take either.
    """

    kind: ClassVar[str] = "table"

    def __init__(self, rows: int, width: int, config: QuantlabConfig, device: torch.device | str | None = None):
        super().__init__()
        self.out_features = rows
        self.in_features = width
        self.config = config
        self._layout = self.layout_for(width, rows, config)  # once: a layout built while tracing cannot be kept
        spec = self.storage_spec(width, rows, config)
        for name, (shape, dtype) in spec.items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device))
        self.stored_names = tuple(spec)  # read on every lookup: a plain tuple traces without a guard
        self.register_parameter("bias", None)

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: QuantlabConfig) -> StorageLayout:
        return vocabulary_layout(out_features, in_features, config)

    @classmethod
    def storage_spec(cls, in_features: int, out_features: int, config: QuantlabConfig) -> StorageSpec:
        tensors = cls.layout_for(in_features, out_features, config).tensors
        return {name: (spec.shape, spec.dtype) for name, spec in tensors.items()}

    @classmethod
    def quantize_checked(
        cls, weight: torch.Tensor, config: QuantlabConfig, layer: str, stats: Any = None
    ) -> dict[str, torch.Tensor]:
        """The stored tensors of a float `[rows, width]` table, rounded to nearest (tables are never calibrated)."""
        if weight.dim() != 2:
            raise QuantizationError(f"{layer}: expected a 2-D table, got shape {tuple(weight.shape)}")
        bad = (~torch.isfinite(weight)).sum().item()
        if bad:
            raise QuantizationError(
                f"{layer}: the table has {bad} NaN/Inf value(s) and cannot be quantized; repair the checkpoint, "
                f"or keep it in float with embedding_bits=None"
            )
        layout = cls.layout_for(weight.shape[1], weight.shape[0], config)
        stored = layout.quantize(weight.detach())
        if not torch.isfinite(stored["weight_scale"]).all():
            raise QuantizationError(
                f"{layer}: a scale overflows float16 (largest value {weight.abs().max().item():.3g}); "
                f"keep the table in float with embedding_bits=None"
            )
        return stored

    @property
    def layout(self) -> StorageLayout:
        layout = self.__dict__.get("_layout")
        if layout is None:
            layout = self._layout = self.layout_for(self.in_features, self.out_features, self.config)
        return layout

    @property
    def format(self) -> str:
        return self.layout.codec

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        return {name: self._buffers[name] for name in self.stored_names}

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored_tensors().values())

    def load_stored(self, stored: dict[str, torch.Tensor]) -> None:
        for name, tensor in stored.items():
            setattr(self, name, tensor.to(getattr(self, name).device))

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float `[rows, width]` table the stored tensors represent."""
        return self._dequantize(self.stored_tensors(), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` of the float table, `[*ids.shape, width]`, decoding only those rows."""
        flat = ids.reshape(-1)
        gathered = {name: tensor.index_select(0, flat) for name, tensor in self.stored_tensors().items()}
        return self._dequantize(gathered, dtype).reshape(*ids.shape, self.in_features)

    def _dequantize(self, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        layout = self.layout
        if not (layout.packed and torch.compiler.is_compiling()):
            return layout.dequantize(stored, dtype)
        # Traced for ONNX, which has no shift on signed integers: the same unpacking in arithmetic.
        codes = unpack_arithmetic(stored["weight"], layout.bits, layout.group_length)
        values = layout.decode(codes, layout.params(stored).scale.unsqueeze(-1), None)
        return grouping.ungroup(values, layout.in_features).to(dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ table.T` (+ bias) through the kernel table, as a quantized Linear layer computes it.

        While torch exports the model (ONNX) the table is dequantized in torch operations
        instead, which an ONNX graph can hold (it has no quantlab kernel).
        """
        if torch.compiler.is_exporting():
            out = F.linear(x, self.dequantize_weight(x.dtype))
            return out if self.bias is None else out + self.bias.to(out.dtype)
        return select_kernel(self.format, x.device.type)(self, x)

    def extra_repr(self) -> str:
        return f"rows={self.out_features}, width={self.in_features}, {self.layout.codec} {self.layout.bits}-bit"

    def stored_tensor_names(self) -> tuple[str, ...]:
        return self.stored_names


class QuantizedEmbedding(QuantizedTable):
    """An `nn.Embedding` whose table is stored quantized; a lookup decodes the rows it gathers."""

    kind = "embedding"

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        config: QuantlabConfig,
        padding_idx: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, config, device)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.output_dtype = torch.float32

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, config: QuantlabConfig, layer: str = "") -> "QuantizedEmbedding":
        module = cls.like(embedding, config)
        module.load_stored(cls.quantize_checked(embedding.weight, config, layer or "embedding"))
        return module

    @classmethod
    def like(cls, embedding: nn.Embedding, config: QuantlabConfig) -> "QuantizedEmbedding":
        """An empty quantized embedding of `embedding`'s shape, on its device (meta while transformers loads)."""
        if embedding.max_norm is not None:
            raise QuantizationError(
                f"an embedding with max_norm={embedding.max_norm} renormalises its rows on lookup, which a stored "
                f"quantized table cannot do; keep it in float with embedding_bits=None"
            )
        weight = embedding.weight
        module = cls(embedding.num_embeddings, embedding.embedding_dim, config, embedding.padding_idx, weight.device)
        module.output_dtype = weight.dtype
        return module

    def to_embedding(self, dtype: torch.dtype | None = None) -> nn.Embedding:
        weight = self.dequantize_weight(dtype or self.output_dtype)
        embedding = nn.Embedding(
            self.num_embeddings, self.embedding_dim, self.padding_idx, device=weight.device, dtype=weight.dtype
        )
        embedding.weight = nn.Parameter(weight)
        return embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids, self.output_dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> "QuantizedEmbedding":
        # The dtype of the rows a lookup returns follows `model.to(dtype)`, as nn.Embedding's would.
        probe = fn(torch.empty(0, dtype=self.output_dtype))
        if probe.is_floating_point():
            self.output_dtype = probe.dtype
        return super()._apply(fn, recurse)


class QuantizedOutputHead(QuantizedTable):
    """An output head (`nn.Linear` to the vocabulary) not tied to the embeddings, stored like the embedding table."""

    kind = "head"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        config: QuantlabConfig,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(out_features, in_features, config, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)

    @classmethod
    def like(cls, linear: nn.Linear, config: QuantlabConfig) -> "QuantizedOutputHead":
        weight = linear.weight
        return cls(
            linear.in_features, linear.out_features, linear.bias is not None, config, weight.dtype, weight.device
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantlabConfig, layer: str = "") -> "QuantizedOutputHead":
        module = cls.like(linear, config)
        module.load_stored(cls.quantize_checked(linear.weight, config, layer or "head"))
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return module

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.float32)
        weight = self.dequantize_weight(dtype)
        linear = nn.Linear(self.in_features, self.out_features, self.bias is not None, weight.device, dtype)
        linear.weight = nn.Parameter(weight)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().to(dtype))
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x)


class TiedOutputHead(nn.Module):
    """The output head of tied embeddings: logits from the embedding's own stored codes, no tensor of its own.

    The embedding is referenced, not registered as a submodule, so it appears once in the
    state dict (under its own name) and the checkpoint stores the table once. A float bias,
    if the head had one, stays here.
    """

    def __init__(self, embedding: QuantizedEmbedding, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.__dict__["_embedding"] = embedding
        self.in_features = embedding.embedding_dim
        self.out_features = embedding.num_embeddings
        self.bias = bias

    @property
    def embedding(self) -> QuantizedEmbedding:
        return self.__dict__["_embedding"]

    @property
    def weight(self) -> torch.Tensor:
        """The embedding's stored codes: what transformers' `tie_weights` sees as the shared weight."""
        return self.embedding.weight

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        # `model.tie_weights()` assigns the embedding's weight to the head: already so.
        if value is not self.embedding.weight:
            raise QuantizationError(
                "the output head is tied to the quantized embedding table and has no weight of its own; "
                "dequantize the model (quantlab.dequantize) before giving it one"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.embedding.logits(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def to_linear(self, embedding: nn.Embedding) -> nn.Linear:
        """A float head tied again to `embedding` (the dequantized embedding)."""
        weight = embedding.weight
        linear = nn.Linear(self.in_features, self.out_features, self.bias is not None, weight.device, weight.dtype)
        linear.weight = weight
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().to(weight.dtype))
        return linear

    def extra_repr(self) -> str:
        return f"tied to the quantized embedding ({self.out_features} x {self.in_features})"
