"""One storage layout per quantized layer: its codec and the numbers that vary between layers.

Every built-in format is a grid per group of `group_size` weights along a row:
`w ≈ (level[q] - zero) * scale`, `q` an unsigned code of `bits` bits.

| codec | levels | zero | stored |
| --- | --- | --- | --- |
| `affine` | 0 .. 2**bits - 1 | float per group, or 2**(bits-1) when symmetric | packed codes, scale (, zero) |
| `int8` | 0 .. 255 | 128 | signed codes `q - 128` (one byte each), scale |
| `nf4` | the 16 NF4 values in [-1, 1] | 0 | packed codes, absmax (plain, or in 8 bits: double quant) |
| `iq4_nl` | llama.cpp's 16 IQ4_NL integers, -127 .. 113 | 0 | packed codes, float16 scale |
| `lut` | a table of 2**bits levels learned per layer, -1 .. 1 | 0 | packed codes, scale, the table |

Options that only one codec has (affine's `symmetric`, nf4's `double_quant`, lut's learned
`table`) are that codec's: `options` holds an instance of the codec's `options_type`, which only
the codec reads. A codec whose levels are learned per layer (`lut`) keeps them in its options: a
layout built from a config has none; `prepare` fits them to a weight before a solver chooses
codes, `bind` reads them back from the layer's stored tensors, and `learned_table` returns them.

Kernels, ONNX lowerings, sparse storage, load verification and the solvers read this one
description. Everything that depends on the format is its codec's (`quantlab.formats.codec`,
one module per format); a `StorageLayout` keeps the shape and options and hands each question
to `codec_object`, so a format registered by a plugin works wherever a built-in one does.
"""

import dataclasses
from typing import Any, NamedTuple

import torch

from quantlab.formats import grouping, packing
from quantlab.formats.codec import Codec, GroupParams, TensorSpec, codec_names, get_codec

__all__ = ["Descriptor", "GroupParams", "StorageLayout", "TensorSpec", "parse_descriptor"]


class Descriptor(NamedTuple):
    """A layout's `descriptor`, read back: absmax_block is 0 without double quantization, zero 0 when
    the zero points are stored (or the codec has none)."""

    codec: str
    bits: int
    in_features: int
    group_size: int
    absmax_block: int = 0
    zero: float = 0.0

    @property
    def codec_object(self) -> Codec:
        return get_codec(self.codec)


def parse_descriptor(text: str) -> Descriptor:
    """The fields of a `StorageLayout.descriptor`; ValueError when `text` is not one."""
    codec, *pairs = text.split(" ")
    fields = dict(pair.partition("=")[::2] for pair in pairs)
    try:
        numbers = {name: int(value) for name, value in fields.items() if name != "zero"}
        descriptor = Descriptor(codec, **numbers, zero=float(fields.get("zero", 0.0)))
    except (TypeError, ValueError) as error:
        raise ValueError(f"not a layout descriptor: {text!r} ({error})") from None
    if codec not in codec_names():
        raise ValueError(f"not a layout descriptor: {text!r} (codec {codec!r} is not one of {codec_names()})")
    return descriptor


@dataclasses.dataclass(frozen=True)
class StorageLayout:
    """What a quantized `[out, in]` weight stores, and the grid its codes index.

    `options` is an instance of the codec's `options_type` (None: its defaults); `build` makes one
    from keywords. Set on construction: `codec_object` (the registered `Codec` named `codec`),
    `tensors` (name → `TensorSpec` of every stored tensor), `descriptor` (the layout in one line, as
    the native operators take it) and `native_arguments` (the stored tensors those operators take, in order).
    """

    codec: str
    bits: int
    group_size: int | None  # None: one group per output channel
    in_features: int
    out_features: int
    scale_dtype: torch.dtype = torch.float32
    options: Any = None  # the codec's `options_type`

    def __post_init__(self) -> None:
        codec = get_codec(self.codec)
        if self.options is None:
            object.__setattr__(self, "options", codec.options_type())
        elif type(self.options) is not codec.options_type:
            raise ValueError(f"the {self.codec} codec takes {codec.options_type.__name__}, got {self.options!r}")
        packing._check_bits(self.bits)
        codec.validate(self)
        # Plain attributes, not functools.cached_property: that one takes a lock on first read
        # (Python < 3.12), which torch.compile cannot trace, and the reference kernel reads a
        # layout's tensors inside the compiled decode step. Not fields: equality, hashing and
        # repr stay those of the description above.
        object.__setattr__(self, "codec_object", codec)
        object.__setattr__(self, "tensors", codec.tensors(self))
        object.__setattr__(self, "descriptor", codec.descriptor(self))
        object.__setattr__(self, "native_arguments", codec.native_arguments(self))

    @classmethod
    def build(
        cls,
        codec: str,
        bits: int,
        group_size: int | None,
        in_features: int,
        out_features: int,
        *,
        scale_dtype: torch.dtype = torch.float32,
        **options: Any,
    ) -> "StorageLayout":
        """A layout whose options are the codec's `options_type` built from the keywords `options`
        (`Codec.options`: ValueError on a name the codec has no option of)."""
        return cls(codec, bits, group_size, in_features, out_features, scale_dtype, get_codec(codec).options(**options))

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
        """Codes packed `bits` to the byte (otherwise one signed byte per code)."""
        return self.codec_object.packed_codes

    @property
    def has_zero(self) -> bool:
        return self.codec_object.has_zero(self)

    @property
    def constant_zero(self) -> float:
        """The zero point when none is stored."""
        return self.codec_object.constant_zero(self)

    def stored_bytes(self) -> int:
        return sum(_numel(spec.shape) * spec.dtype.itemsize for spec in self.tensors.values())

    def bits_per_weight(self) -> float:
        return 8 * self.stored_bytes() / (self.in_features * self.out_features)

    # -- the grid ---------------------------------------------------------------------------

    def levels(self, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The sorted table of values a code indexes, or None for the integers 0 .. 2**bits - 1."""
        return self.codec_object.levels(self, device)

    @property
    def max_code(self) -> int:
        return (1 << self.bits) - 1

    def encode(self, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """Nearest code of each value for grids `scale`/`zero` broadcast against it (uint8)."""
        return self.codec_object.encode(self, values, scale, zero)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """`(level[q] - zero) * scale` in float32."""
        return self.codec_object.decode(self, codes, scale, zero)

    def round_trip(
        self, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(decode(encode(values)), level of each code)`, in one go (`Codec.round_trip`)."""
        return self.codec_object.round_trip(self, values, scale, zero)

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
        return self.codec_object.fit(self, grouped, clip, signed and self.signed_grids)

    @property
    def fits_groups_together(self) -> bool:
        """Whether the stored grids of a layer's groups depend on each other (NF4's double quantization
        compresses all absmax together): `fit` and `grid` then take all groups at once, and a solver
        fixes the grids before it chooses codes."""
        return self.codec_object.fits_groups_together(self)

    @property
    def signed_grids(self) -> bool:
        """Whether a grid's scale may be negative: symmetric integer codes, whose lowest level
        `-2**(b-1)` has no positive mirror, so a group whose extreme weight is positive reaches it
        only through a negative scale (llama.cpp's Q4_0/k-quants do the same)."""
        return self.codec_object.signed_grids(self)

    def grid(self, scale: torch.Tensor, zero: torch.Tensor | None = None) -> GroupParams:
        """Grids `[out, groups]` from float scales (and zero points), rounded to what is stored.

        A zero (or underflowed) scale becomes 1, which represents a group of zeros exactly.
        NF4 under double quantization compresses all absmax of the layer together: pass them all.
        """
        return self.codec_object.grid(self, scale, zero)

    def prepare(self, weight: torch.Tensor, channel_weights: torch.Tensor | None = None) -> "StorageLayout":
        """This layout with whatever its codec learns per layer (a level table) fitted to the float
        `[out, in]` weight, an input channel's error weighted by `channel_weights` (E[x_j^2]); the
        layout itself for codecs with nothing to learn. Solvers choose codes on the result."""
        return self.codec_object.prepare(self, weight, channel_weights)

    def bind(self, stored: dict[str, torch.Tensor]) -> "StorageLayout":
        """This layout with the per-layer numbers (a level table) the stored tensors carry; itself otherwise."""
        return self.codec_object.bind(self, stored)

    @property
    def learned_table(self) -> tuple[float, ...] | None:
        """The level table this layer learned (sorted, its ends included), or None when the codec learns
        none or it is not fitted yet."""
        return self.codec_object.learned_table(self)

    def with_table(self, levels: torch.Tensor) -> "StorageLayout":
        """This layout with its learned level table (`learned_table`) replaced by the sorted `levels`, rounded as
        they are stored, so codes decode as the saved layer will (training the table: `quantlab.nn.grid_trained`)."""
        return self.codec_object.with_table(self, levels)

    def quantize_grouped(self, grouped: torch.Tensor, params: GroupParams) -> torch.Tensor:
        """Codes `[out, groups, length]` of grouped weights on the given grids."""
        return self.codec_object.encode_grouped(self, grouped, params)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored tensors of a float `[out, in]` weight by the codec's round-to-nearest."""
        return self.codec_object.quantize(self, weight)

    # -- stored tensors ---------------------------------------------------------------------

    def store(self, codes: torch.Tensor, params: GroupParams) -> dict[str, torch.Tensor]:
        """Codes `[out, groups, length]` (uint8 indices) and their grids → the layer's tensors."""
        return self.codec_object.store(self, codes, params)

    def load(self, stored: dict[str, torch.Tensor]) -> tuple[torch.Tensor, GroupParams]:
        """The layer's tensors → codes `[out, groups, length]` (uint8 indices) and float32 grids."""
        return self.codec_object.load(self, stored)

    def codes(self, weight: torch.Tensor) -> torch.Tensor:
        """The `weight` buffer → unsigned codes `[out, groups, length]`."""
        return self.codec_object.codes(self, weight)

    def params(self, stored: dict[str, torch.Tensor]) -> GroupParams:
        return self.codec_object.params(self, stored)

    def dequantize(self, stored: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float `[out, in]` weight the stored tensors represent: the reference every kernel matches."""
        return self.codec_object.dequantize(self, stored, dtype)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
