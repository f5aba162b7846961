"""The `Codec`: everything quantlab knows about one storage format, and the registry of codecs.

A storage layout (`quantlab.formats.layout.StorageLayout`) names its codec and carries the
numbers that vary between layers (bits, group size, shape, scale dtype) and the codec's own
options (an instance of the codec's `options_type`, which the layout never looks into); the codec
answers every question whose answer depends on the format: which tensors are stored, how a
float weight becomes codes (round to nearest) and how codes decode, how stored tensors are
written and read back, what the native kernels and ONNX exporter need, which GGUF block type
holds its codes exactly (`gguf_type`, `gguf_blocks`), whether its numbers are an integer grid
that compressed-tensors and GPTQ checkpoints store (`integer_grid`, `from_integer_grid`), and how
`inspect` labels it. Code
outside `quantlab.formats` asks the codec; it never branches on a codec name.

A new format is one module: subclass `Codec`, implement `tensors`, `quantize` and `dequantize`
(and the grid methods if solvers should work on it), declare its options as a frozen dataclass
(`options_type`) if it has any, and `register_codec` an instance. Every method takes the layer's
layout, so one codec object serves every layer of its format.
"""

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from quantlab.formats import grouping

if TYPE_CHECKING:
    from quantlab.formats.layout import Descriptor, StorageLayout


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class GGUFBlocks:
    """A weight's codes as the blocks of one GGUF type hold them: the numbers of every block of
    `GGUF_BLOCK` weights along a row, before they are laid out in bytes.

    `type` is the GGUF type's name ("Q4_0", "Q4_1", "Q8_0", "IQ4_NL"); `codes` `[out, in]` are what a
    block stores per weight (unsigned 0..15 for the 4-bit types, signed int8 for Q8_0); `scale` is each
    block's `d` and `min` its `m` (Q4_1 only), `[out, in // GGUF_BLOCK]` float16. A block decodes as
    `(q - 8) * d` (Q4_0), `q * d + m` (Q4_1), `q * d` (Q8_0) or `kvalues_iq4nl[q] * d` (IQ4_NL).
    """

    type: str
    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None = None


class NotExactInGGUF(ValueError):
    """A layout's stored numbers have no GGUF block type that holds them exactly; the message says why."""


GGUF_BLOCK = 32  # weights per block of the GGUF types codecs map to


def float16_exact(values: torch.Tensor, what: str) -> torch.Tensor:
    """`values` as float16, or NotExactInGGUF when some value is not a float16 number (rounded or out of range)."""
    half = values.to(torch.float16)
    if not torch.equal(half.double(), values.double()):
        worst = (half.double() - values.double()).abs().nan_to_num(float("inf")).argmax()
        raise NotExactInGGUF(
            f"{what} {values.reshape(-1)[worst].item():.9g} is not a float16 number (GGUF blocks store float16)"
        )
    return half


def per_block(params: torch.Tensor, layout: "StorageLayout") -> torch.Tensor:
    """Per-group numbers `[out, groups]` repeated for each block of `GGUF_BLOCK` weights of a row
    `[out, in // GGUF_BLOCK]`; NotExactInGGUF when a block would straddle two groups."""
    if layout.in_features % GGUF_BLOCK or layout.group_length % GGUF_BLOCK:
        raise NotExactInGGUF(
            f"{layout.in_features} input features in groups of {layout.group_length} do not split into the "
            f"{GGUF_BLOCK}-weight blocks of GGUF (both must be multiples of {GGUF_BLOCK})"
        )
    repeated = params.repeat_interleave(layout.group_length // GGUF_BLOCK, dim=1)
    return repeated[:, : layout.in_features // GGUF_BLOCK]


@dataclasses.dataclass(frozen=True)
class IntegerGrid:
    """A weight as unsigned integer codes on a uniform grid per group, `w = (q - zero) * scale`: the
    numbers compressed-tensors (int4/int8 "pack-quantized") and GPTQ checkpoints store.

    `codes` `[out, in]` uint8 in `0 .. 2**bits - 1`; `scale` `[out, groups]` in its stored dtype;
    `zero` `[out, groups]` uint8 integer zero points in the same range, or None for the midpoint
    `2**(bits-1)` (symmetric). `group_size` None: one group per output row. Groups never straddle
    the end of a row (`in` is a multiple of `group_size`).
    """

    bits: int
    group_size: int | None
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    @property
    def symmetric(self) -> bool:
        return self.zero is None


class NotAnIntegerGrid(ValueError):
    """A layout's stored numbers are not integer codes on a uniform grid (or its zero points are not
    integers in range); the message says why."""


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


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a codec that has none."""


class Codec:
    """One storage format. Subclasses set `name` and implement at least `tensors`, `quantize`
    and `dequantize`; the grid methods (`fit`, `grid`, `encode`, `decode`, `store`, `load`) serve
    the solvers and are implemented by codecs whose codes index a per-group grid.

    Class attributes:
    - `native_kind`: the `ql_weight.kind` the native kernels decode this format as (the C enum
      in `kernels/cpu/csrc/quantlab_cpu.h`), or None when only the reference kernel runs it.
    - `onnx_lowering`: which lowering of `quantlab.export` computes it ("integer-grid",
      "level-table"), or None for the exporter's fallback (the dequantized weight and a MatMul).
    - `packed_codes`: whether `weight` holds codes packed `bits` to the byte
      (`quantlab.formats.packing`); otherwise one signed byte per code.
    - `native_table_argument`: the native operators take the layer's own level table in the
      zero point's position of `native_arguments` (a table kind has no zero point).
    - `options_type`: a frozen (hence hashable) dataclass of the codec's own options, whose
      defaults describe a layout built without any; a layout holds one as `layout.options`.
    """

    name: ClassVar[str]
    native_kind: ClassVar[int | None] = None
    onnx_lowering: ClassVar[str | None] = None
    packed_codes: ClassVar[bool] = True
    native_table_argument: ClassVar[bool] = False
    options_type: ClassVar[type] = NoOptions

    def options(self, **values: Any) -> Any:
        """This codec's `options_type` with `values` set (the rest at their defaults); ValueError
        naming the codec's options when a name is not one of them."""
        names = [field.name for field in dataclasses.fields(self.options_type) if field.init]
        unknown = sorted(set(values) - set(names))
        if unknown:
            known = ", ".join(names) if names else "none"
            raise ValueError(f"the {self.name} codec has no option {', '.join(unknown)} (its options: {known})")
        return self.options_type(**values)

    # -- what a layout of this codec stores --------------------------------------------------

    def validate(self, layout: "StorageLayout") -> None:
        """Raise ValueError when `layout`'s options make no sense for this codec."""

    def tensors(self, layout: "StorageLayout") -> dict[str, TensorSpec]:
        """Name → shape and dtype of every stored tensor; `weight` holds the codes `[out, groups, bytes]`."""
        raise NotImplementedError(f"codec {self.name!r} does not say which tensors it stores")

    def descriptor(self, layout: "StorageLayout") -> str:
        """The layout in one line, as the native operators take it (`parse_descriptor` reads it back)."""
        return f"{self.name} bits={layout.bits} in_features={layout.in_features} group_size={layout.group_length}"

    def native_arguments(self, layout: "StorageLayout") -> tuple[str | None, ...]:
        """Names of the stored tensors the native operators take after the codes, in their order
        (scale, zero, absmax_codes, absmax_scale, absmax_offset), None for one left out in the middle
        and the trailing absent ones dropped. Empty for a codec the native kernels do not decode."""
        return ()

    def native_tables(self) -> dict[str, tuple[float, ...]]:
        """Lookup tables the native kernels read with the codes (`ql_weight` field → values)."""
        return {}

    # -- numbers learned per layer ------------------------------------------------------------

    def prepare(
        self, layout: "StorageLayout", weight: torch.Tensor, channel_weights: torch.Tensor | None = None
    ) -> "StorageLayout":
        """`layout` with the codec's per-layer numbers fitted to `weight` (see `StorageLayout.prepare`)."""
        return layout

    def bind(self, layout: "StorageLayout", stored: dict[str, torch.Tensor]) -> "StorageLayout":
        """`layout` with the per-layer numbers read from the stored tensors (see `StorageLayout.bind`)."""
        return layout

    def learned_table(self, layout: "StorageLayout") -> tuple[float, ...] | None:
        """The level table `layout` learned for its layer (sorted, ends included), or None when the codec
        learns none or it is not fitted yet (see `StorageLayout.learned_table`)."""
        return None

    def with_table(self, layout: "StorageLayout", levels: torch.Tensor) -> "StorageLayout":
        """`layout` with its learned level table replaced by `levels` (see `StorageLayout.with_table`)."""
        raise ValueError(f"the {self.name} codec learns no level table")

    # -- round to nearest, and the reference decoding -------------------------------------------

    def quantize(self, layout: "StorageLayout", weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Float `[out, in]` weight → the stored tensors, by round-to-nearest: the definition every
        fast path must match bit for bit. The default fits the grid and stores the nearest codes."""
        grouped = grouping.group(weight.float(), layout.group_size)
        params = self.fit(layout, grouped)
        return self.store(layout, self.encode_grouped(layout, grouped, params), params)

    def dequantize(
        self, layout: "StorageLayout", stored: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The float `[out, in]` weight the stored tensors represent: the reference every kernel matches."""
        layout = self.bind(layout, stored)
        codes, params = self.load(layout, stored)
        zero = None if params.zero is None else params.zero.unsqueeze(-1)
        values = self.decode(layout, codes, params.scale.unsqueeze(-1), zero)
        return grouping.ungroup(values, layout.in_features).to(dtype)

    # -- the per-group grid (solvers) -----------------------------------------------------------

    def has_zero(self, layout: "StorageLayout") -> bool:
        """Whether a zero point is stored per group."""
        return False

    def constant_zero(self, layout: "StorageLayout") -> float:
        """The zero point when none is stored."""
        return 0.0

    def levels(self, layout: "StorageLayout", device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The sorted table of values a code indexes, or None for the integers 0 .. 2**bits - 1."""
        return None

    def signed_grids(self, layout: "StorageLayout") -> bool:
        """Whether a grid's scale may be negative (see `StorageLayout.signed_grids`)."""
        return False

    def fits_groups_together(self, layout: "StorageLayout") -> bool:
        """Whether the stored grids of a layer's groups depend on each other (see
        `StorageLayout.fits_groups_together`)."""
        return False

    def fit(
        self, layout: "StorageLayout", grouped: torch.Tensor, clip: torch.Tensor | float = 1.0, signed: bool = False
    ) -> GroupParams:
        """Round-to-nearest grids of grouped weights, as stored (see `StorageLayout.fit`)."""
        raise self._no_grid("fit")

    def grid(self, layout: "StorageLayout", scale: torch.Tensor, zero: torch.Tensor | None = None) -> GroupParams:
        """Grids `[out, groups]` from float scales (and zero points), rounded to what is stored."""
        raise self._no_grid("grid")

    def encode(
        self, layout: "StorageLayout", values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> torch.Tensor:
        """Nearest code (uint8) of each value for grids broadcast against it."""
        raise self._no_grid("encode")

    def decode(
        self, layout: "StorageLayout", codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> torch.Tensor:
        """`(level[q] - zero) * scale` in float32."""
        raise self._no_grid("decode")

    def round_trip(
        self, layout: "StorageLayout", values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(decoded, level)`: `decode(encode(values))` and the grid level (float) of each value's code, in
        one go (a fake quantizer computes both at every training step). Codecs may fuse it; the result
        must equal this definition bit for bit."""
        codes = self.encode(layout, values, scale, zero)
        levels = self.levels(layout, values.device)
        level = codes.float() if levels is None else levels.float()[codes.long()]
        return self.decode(layout, codes, scale, zero), level

    def encode_grouped(self, layout: "StorageLayout", grouped: torch.Tensor, params: GroupParams) -> torch.Tensor:
        """Codes `[out, groups, length]` of grouped weights on the given grids."""
        zero = None if params.zero is None else params.zero.unsqueeze(-1)
        return self.encode(layout, grouped, params.scale.unsqueeze(-1), zero)

    def store(self, layout: "StorageLayout", codes: torch.Tensor, params: GroupParams) -> dict[str, torch.Tensor]:
        """Codes `[out, groups, length]` (uint8 indices) and their grids → the layer's tensors."""
        raise self._no_grid("store")

    def load(self, layout: "StorageLayout", stored: dict[str, torch.Tensor]) -> tuple[torch.Tensor, GroupParams]:
        """The layer's tensors → codes `[out, groups, length]` (uint8 indices) and float32 grids."""
        return self.codes(layout, stored["weight"]), self.params(layout, stored)

    def codes(self, layout: "StorageLayout", weight: torch.Tensor) -> torch.Tensor:
        """The `weight` buffer → unsigned codes `[out, groups, length]`."""
        raise self._no_grid("codes")

    def params(self, layout: "StorageLayout", stored: dict[str, torch.Tensor]) -> GroupParams:
        """The layer's tensors → its float32 grids."""
        raise self._no_grid("params")

    # -- what other parts of quantlab ask ---------------------------------------------------------

    def label(self, layout: "StorageLayout") -> str:
        """How `quantlab inspect` names this format."""
        return self.name

    def int8_activations(self, descriptor: "Descriptor") -> bool:
        """Whether the native int8-activation kernel (`ql_a8_eligible`) takes a layer of this layout."""
        return False

    def gguf_type(self, layout: "StorageLayout") -> str | None:
        """The GGUF block type that can hold this layout's codes exactly, or None when none can.
        Whether a given layer's numbers fit (float16 scales, whole blocks) is `gguf_blocks`' check."""
        return None

    def gguf_blocks(self, layout: "StorageLayout", stored: dict[str, torch.Tensor]) -> GGUFBlocks:
        """The stored tensors as the blocks of `gguf_type`, decoding to exactly `dequantize`'s values;
        NotExactInGGUF, saying why, when the numbers do not fit."""
        raise NotExactInGGUF(f"codec {self.name!r} has no GGUF block type that holds its codes")

    def integer_grid(self, layout: "StorageLayout", stored: dict[str, torch.Tensor]) -> IntegerGrid:
        """The stored tensors as integer codes, scales and integer zero points, decoding to exactly
        `dequantize`'s values (in float32); NotAnIntegerGrid, saying why, when they are not that."""
        raise NotAnIntegerGrid(f"codec {self.name!r} does not store integer codes on a uniform grid")

    def from_integer_grid(self, layout: "StorageLayout", grid: IntegerGrid) -> dict[str, torch.Tensor]:
        """The stored tensors of `layout` holding `grid`'s numbers exactly (the inverse of `integer_grid`);
        NotAnIntegerGrid when the layout cannot hold them."""
        raise NotAnIntegerGrid(f"codec {self.name!r} does not store integer codes on a uniform grid")

    def describe(self, layout: "StorageLayout") -> dict[str, Any]:
        """The numbers an exporter needs, in plain Python: bits, group length, zero point kind
        ("stored", "constant" or "none"), scale dtype, level table (None: integer codes)."""
        levels = self.levels(layout)
        if self.has_zero(layout):
            zero: dict[str, Any] = {"zero_point": "stored"}
        else:
            zero = {"zero_point": "constant", "constant_zero": self.constant_zero(layout)}
        return {
            "codec": self.name,
            "bits": layout.bits,
            "group_length": layout.group_length,
            **zero,
            "scale_dtype": str(layout.scale_dtype).removeprefix("torch."),
            "levels": None if levels is None else levels.tolist(),
            "signed_grids": self.signed_grids(layout),
        }

    def _no_grid(self, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"codec {self.name!r} has no per-group grid ({what}): quantize it with its own round-to-nearest "
            f"(solver='rtn')"
        )


_CODECS: dict[str, Codec] = {}


def register_codec(codec: Codec) -> Codec:
    """Make `codec` the one `StorageLayout`s naming `codec.name` use; returns it."""
    if not getattr(codec, "name", None):
        raise ValueError(f"{type(codec).__name__} has no name; set the class attribute `name`")
    _CODECS[codec.name] = codec
    return codec


def get_codec(name: str) -> Codec:
    """The registered codec called `name`; ValueError naming the known ones otherwise."""
    codec = _CODECS.get(name)
    if codec is None:
        raise ValueError(f"codec {name!r} is not one of {codec_names()}; register it with register_codec")
    return codec


def codec_names() -> tuple[str, ...]:
    """The registered codecs, in registration order."""
    return tuple(_CODECS)


def native_codecs() -> dict[str, int]:
    """Codec name → native kernel kind, for every codec the native kernels decode."""
    return {name: codec.native_kind for name, codec in _CODECS.items() if codec.native_kind is not None}
