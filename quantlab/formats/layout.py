"""One storage layout per quantized layer: what it stores and how its codes decode.

Every built-in format is a grid per group of `group_size` weights along a row:
`w ≈ (level[q] - zero) * scale`, `q` an unsigned code of `bits` bits.

| codec | levels | zero | stored |
| --- | --- | --- | --- |
| `affine` | 0 .. 2**bits - 1 | float per group, or 2**(bits-1) when symmetric | packed codes, scale (, zero) |
| `int8` | 0 .. 255 | 128 | signed codes `q - 128` (one byte each), scale |
| `nf4` | the 16 NF4 values in [-1, 1] | 0 | packed codes, absmax (plain, or in 8 bits: double quant) |

Kernels, ONNX lowerings, sparse storage, load verification and the solvers read this one
description; the solvers choose codes and group parameters, `store` turns them into the
layer's tensors and `load` reads them back. Nothing here knows about modules or devices
beyond torch, so everything is testable bit-exactly.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from quantlab.formats import grouping, nf4, packing

CODECS = ("affine", "int8", "nf4")
INT8_OFFSET = 128


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass
class GroupParams:
    """Per-group grid parameters `[out, groups]` as stored (float32 values of the stored numbers).

    `zero` is None when the codec's zero point is a constant. `stored` holds extra tensors a
    codec derives from the parameters when they are fitted (NF4's 8-bit absmax), so `store`
    writes exactly the numbers the codes were chosen against.
    """

    scale: torch.Tensor
    zero: torch.Tensor | None = None
    stored: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def group(self, index: int | slice) -> "GroupParams":
        """The parameters of some groups only (`[out, k]`), for solvers that walk the columns."""
        index = index if isinstance(index, slice) else slice(index, index + 1)
        zero = None if self.zero is None else self.zero[:, index]
        return GroupParams(self.scale[:, index], zero)


class Descriptor(NamedTuple):
    """A layout's `descriptor`, read back: absmax_block is 0 without double quantization, zero 0 when
    the zero points are stored (or the codec has none)."""

    codec: str
    bits: int
    in_features: int
    group_size: int
    absmax_block: int = 0
    zero: float = 0.0


def parse_descriptor(text: str) -> Descriptor:
    """The fields of a `StorageLayout.descriptor`; ValueError when `text` is not one."""
    codec, *pairs = text.split(" ")
    fields = dict(pair.partition("=")[::2] for pair in pairs)
    try:
        numbers = {name: int(value) for name, value in fields.items() if name != "zero"}
        descriptor = Descriptor(codec, **numbers, zero=float(fields.get("zero", 0.0)))
    except (TypeError, ValueError) as error:
        raise ValueError(f"not a layout descriptor: {text!r} ({error})") from None
    if codec not in CODECS:
        raise ValueError(f"not a layout descriptor: {text!r} (codec {codec!r} is not one of {CODECS})")
    return descriptor


@dataclasses.dataclass(frozen=True)
class StorageLayout:
    """What a quantized `[out, in]` weight stores, and the grid its codes index.

    `tensors` (set on construction): name → `TensorSpec` of every stored tensor; `descriptor`: the
    layout in one line, as the native operators take it.
    """

    codec: str
    bits: int
    group_size: int | None  # None: one group per output channel
    in_features: int
    out_features: int
    symmetric: bool = True  # affine only: no stored zero point
    scale_dtype: torch.dtype = torch.float32
    double_quant: bool = False  # nf4 only: absmax stored in 8 bits

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"codec {self.codec!r} is not one of {CODECS}")
        packing._check_bits(self.bits)
        # A plain attribute, not a functools.cached_property: that one takes a lock on first
        # read (Python < 3.12), which torch.compile cannot trace, and the reference kernel reads
        # a layout's tensors inside the compiled decode step. Not a field: equality, hashing and
        # repr stay those of the description above.
        object.__setattr__(self, "tensors", self._tensor_specs())
        object.__setattr__(self, "descriptor", self._descriptor())

    # -- shape ------------------------------------------------------------------------------

    @property
    def groups(self) -> int:
        return grouping.num_groups(self.in_features, self.group_size)

    @property
    def group_length(self) -> int:
        """Weights per group (the row length when per channel), padding included."""
        return grouping.effective_group_size(self.in_features, self.group_size)

    @property
    def packed(self) -> bool:
        """Codes packed `bits` to the byte (int8 stores one signed byte per code)."""
        return self.codec != "int8"

    @property
    def has_zero(self) -> bool:
        return self.codec == "affine" and not self.symmetric

    @property
    def constant_zero(self) -> float:
        """The zero point when none is stored."""
        if self.codec == "nf4":
            return 0.0
        return float(1 << (self.bits - 1))

    def _descriptor(self) -> str:
        """The codec and the integers that decode its codes, in one line (`parse_descriptor` reads it):
        what the native operators take beside the stored tensors (`quantlab::linear`), e.g.
        "affine bits=4 in_features=576 group_size=64 zero=8". One string, not six numbers: an eager
        operator call converts each Python argument on its own, ~0.1 us apiece."""
        text = f"{self.codec} bits={self.bits} in_features={self.in_features} group_size={self.group_length}"
        if self.codec == "nf4" and self.double_quant:
            text += f" absmax_block={nf4.ABSMAX_BLOCKSIZE}"
        if self.codec == "affine" and not self.has_zero:
            text += f" zero={self.constant_zero:g}"
        return text

    def _tensor_specs(self) -> dict[str, TensorSpec]:
        """Name → shape and dtype of every stored tensor; `weight` holds the codes `[out, groups, bytes]`."""
        out, groups = self.out_features, self.groups
        code_bytes = packing.packed_size(self.group_length, self.bits) if self.packed else self.group_length
        code_dtype = torch.uint8 if self.packed else torch.int8
        specs = {"weight": TensorSpec((out, groups, code_bytes), code_dtype)}
        if self.codec == "nf4":
            if self.double_quant:
                absmax_blocks = -(-out * groups // nf4.ABSMAX_BLOCKSIZE)
                specs["weight_absmax_codes"] = TensorSpec((out, groups), torch.uint8)
                specs["weight_absmax_scale"] = TensorSpec((absmax_blocks,), torch.float32)
                specs["weight_absmax_offset"] = TensorSpec((1,), torch.float32)
            else:
                specs["weight_absmax"] = TensorSpec((out, groups), torch.float32)
            return specs
        specs["weight_scale"] = TensorSpec((out, groups), self.scale_dtype)
        if self.has_zero:
            specs["weight_zero"] = TensorSpec((out, groups), self.scale_dtype)
        return specs

    def stored_bytes(self) -> int:
        return sum(_numel(spec.shape) * spec.dtype.itemsize for spec in self.tensors.values())

    def bits_per_weight(self) -> float:
        return 8 * self.stored_bytes() / (self.in_features * self.out_features)

    # -- the grid ---------------------------------------------------------------------------

    def levels(self, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The sorted table of values a code indexes, or None for the integers 0 .. 2**bits - 1."""
        return nf4.levels(device) if self.codec == "nf4" else None

    @property
    def max_code(self) -> int:
        return (1 << self.bits) - 1

    def encode(self, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """Nearest code of each value for grids `scale`/`zero` broadcast against it (uint8)."""
        target = values.float() / scale.float() + (zero.float() if zero is not None else self.constant_zero)
        levels = self.levels(values.device)
        if levels is None:
            return torch.round(target).clamp_(0, self.max_code).to(torch.uint8)
        midpoints = (levels[:-1] + levels[1:]) / 2
        return torch.bucketize(target.contiguous(), midpoints).to(torch.uint8)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """`(level[q] - zero) * scale` in float32."""
        levels = self.levels(codes.device)
        values = codes.float() if levels is None else levels[codes.long()]
        return (values - (zero.float() if zero is not None else self.constant_zero)) * scale.float()

    def fit(self, grouped: torch.Tensor, clip: torch.Tensor | float = 1.0, signed: bool = False) -> GroupParams:
        """Round-to-nearest grids of grouped weights `[out, groups, length]`, the range shrunk by `clip`.

        `clip` (a ratio per group `[out, groups]`, or one number) scales the group's range, the
        knob of the MSE clipping search. The parameters come back as stored: cast to the scale
        dtype, NF4's absmax through double quantization, so codes chosen against them decode
        exactly as the layer will. Double quantization mixes all groups of a layer: fit them all at once.

        `signed` (symmetric integer grids only, see `signed_grids`): the group's largest-magnitude
        weight goes to the lowest code, `-2**(b-1)`, through a scale of its opposite sign, so all
        `2**b` levels serve the group (round-to-nearest uses `2**b - 1`: `±(2**(b-1) - 1)`).
        """
        grouped = grouped.float()
        clip = torch.as_tensor(clip, dtype=torch.float32, device=grouped.device)
        if self.codec == "nf4":
            return self.grid(grouped.abs().amax(dim=-1) * clip)
        if not self.has_zero:
            if signed and self.signed_grids:
                extreme = grouped.gather(-1, grouped.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
                return self.grid(-extreme * clip / self.constant_zero)
            qmax = (1 << (self.bits - 1)) - 1
            return self.grid(grouped.abs().amax(dim=-1) * clip / qmax)
        low = grouped.amin(dim=-1) * clip
        high = grouped.amax(dim=-1) * clip
        scale = _as_stored((high - low) / self.max_code, self.scale_dtype)
        return self.grid(scale, -low / scale)

    @property
    def signed_grids(self) -> bool:
        """Whether a grid's scale may be negative: symmetric integer codes, whose lowest level
        `-2**(b-1)` has no positive mirror, so a group whose extreme weight is positive reaches it
        only through a negative scale (llama.cpp's Q4_0/k-quants do the same)."""
        return self.codec == "affine" and not self.has_zero

    def grid(self, scale: torch.Tensor, zero: torch.Tensor | None = None) -> GroupParams:
        """Grids `[out, groups]` from float scales (and zero points), rounded to what is stored.

        A zero (or underflowed) scale becomes 1, which represents a group of zeros exactly.
        NF4 under double quantization compresses all absmax of the layer together: pass them all.
        """
        if self.codec == "nf4":
            if not self.double_quant:
                return GroupParams(scale=scale.float())
            codes, dq_scale, offset = nf4.quantize_absmax(scale.float(), nf4.ABSMAX_BLOCKSIZE)
            stored = {"weight_absmax_codes": codes, "weight_absmax_scale": dq_scale, "weight_absmax_offset": offset}
            absmax = nf4.dequantize_absmax(codes, dq_scale, offset, nf4.ABSMAX_BLOCKSIZE)
            return GroupParams(scale=absmax, stored=stored)
        scale = _as_stored(scale, self.scale_dtype)
        if not self.has_zero:
            return GroupParams(scale=scale)
        return GroupParams(scale=scale, zero=zero.to(self.scale_dtype).float())

    def quantize_grouped(self, grouped: torch.Tensor, params: GroupParams) -> torch.Tensor:
        """Codes `[out, groups, length]` of grouped weights on the given grids."""
        zero = None if params.zero is None else params.zero.unsqueeze(-1)
        return self.encode(grouped, params.scale.unsqueeze(-1), zero)

    # -- stored tensors ---------------------------------------------------------------------

    def store(
        self,
        codes: torch.Tensor,
        params: GroupParams,
        pack: Callable[[torch.Tensor, int], torch.Tensor] = packing.pack,
    ) -> dict[str, torch.Tensor]:
        """Codes `[out, groups, length]` (uint8 indices) and their grids → the layer's tensors.

        `pack` packs the codes (`packing.pack` is the definition; callers may pass a native equivalent)."""
        if self.packed:
            stored = {"weight": pack(codes.to(torch.uint8), self.bits)}
        else:
            stored = {"weight": (codes.to(torch.int16) - INT8_OFFSET).to(torch.int8)}
        if self.codec == "nf4":
            if self.double_quant:
                stored.update(params.stored)
            else:
                stored["weight_absmax"] = params.scale.float()
            return stored
        stored["weight_scale"] = params.scale.to(self.scale_dtype)
        if self.has_zero:
            stored["weight_zero"] = params.zero.to(self.scale_dtype)
        return stored

    def load(self, stored: dict[str, torch.Tensor]) -> tuple[torch.Tensor, GroupParams]:
        """The layer's tensors → codes `[out, groups, length]` (uint8 indices) and float32 grids."""
        return self.codes(stored["weight"]), self.params(stored)

    def codes(self, weight: torch.Tensor) -> torch.Tensor:
        """The `weight` buffer → unsigned codes `[out, groups, length]`."""
        if self.packed:
            return packing.unpack(weight, self.bits, self.group_length)
        return (weight.to(torch.int16) + INT8_OFFSET).to(torch.uint8)

    def params(self, stored: dict[str, torch.Tensor]) -> GroupParams:
        if self.codec == "nf4":
            if not self.double_quant:
                return GroupParams(scale=stored["weight_absmax"].float())
            absmax = nf4.dequantize_absmax(
                stored["weight_absmax_codes"],
                stored["weight_absmax_scale"],
                stored["weight_absmax_offset"],
                nf4.ABSMAX_BLOCKSIZE,
            )
            return GroupParams(scale=absmax)
        zero = stored["weight_zero"].float() if self.has_zero else None
        return GroupParams(scale=stored["weight_scale"].float(), zero=zero)

    def dequantize(self, stored: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float `[out, in]` weight the stored tensors represent: the reference every kernel matches."""
        codes, params = self.load(stored)
        zero = None if params.zero is None else params.zero.unsqueeze(-1)
        values = self.decode(codes, params.scale.unsqueeze(-1), zero)
        return grouping.ungroup(values, self.in_features).to(dtype)


def _as_stored(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale rounded to its storage dtype, as float32; a zero (or underflowed) scale becomes 1."""
    stored = scale.to(dtype)
    return torch.where(stored == 0, torch.ones_like(stored), stored).float()


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
