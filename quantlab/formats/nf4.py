"""NormalFloat-4 with optional double quantization (Dettmers et al., QLoRA, arXiv 2305.14314).

Each block of `blocksize` weights is divided by its absmax and mapped to the nearest of the
16 NF4 levels (quantiles of a standard normal, rescaled to [-1, 1]); the nearest level is
found by bucketing against the midpoints, as bitsandbytes does, so the codes equal theirs.
Double quantization stores the per-block absmax in 8 bits: the mean is subtracted and the
rest is quantized in blocks of 256 with bitsandbytes' signed dynamic 8-bit map, each block
keeping one float32 scale. That costs 8/64 + 32/(64*256) bits per weight at blocksize 64.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import TYPE_CHECKING

import torch

from quantlab.formats import fast_path, grouping, packing
from quantlab.formats.codec import (
    Codec,
    GGUFBlocks,
    GroupParams,
    IntegerGrid,
    NotAnIntegerGrid,
    NotExactInGGUF,
    TensorSpec,
    register_codec,
)
from quantlab.utils.compile_constants import constant_result

if TYPE_CHECKING:
    from quantlab.formats.layout import StorageLayout

NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
ABSMAX_BLOCKSIZE = 256
BITS = 4


def levels(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


@constant_result
def dynamic_map() -> tuple[float, ...]:
    """The signed dynamic 8-bit map of Dettmers (arXiv 1511.04561), as bitsandbytes builds it.

    A constant to torch.compile: the reference kernel decodes double-quantized absmax inside the
    compiled decode step, and dynamo would otherwise trace the construction below (it ignores
    `functools.cache`), whose `tolist()` it cannot.
    """
    return _build_dynamic_map()


@cache
def _build_dynamic_map() -> tuple[float, ...]:
    max_exponent_bits, non_sign_bits = 7, 7
    values: list[float] = []
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = ((boundaries[:-1] + boundaries[1:]) / 2.0).tolist()
        magnitude = 10 ** (-(max_exponent_bits - 1) + i)
        values += [magnitude * m for m in means] + [-magnitude * m for m in means]
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return tuple(sorted(values))


def quantize_absmax(absmax: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Second level: `absmax - mean` in blocks of `blocksize` with the dynamic 8-bit map."""
    offset = absmax.mean().reshape(1)
    centred = _blocks(absmax - offset, blocksize)
    scale = centred.abs().amax(dim=-1)
    scaled = (centred / scale.clamp(min=1e-38).unsqueeze(-1)).clamp_(-1, 1)
    code_map = torch.tensor(dynamic_map(), dtype=torch.float32, device=absmax.device)
    codes = fast_path.bucketize(scaled, midpoints(code_map)).to(torch.uint8)
    return codes.reshape(-1)[: absmax.numel()].reshape(absmax.shape), scale, offset


def dequantize_absmax(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, blocksize: int) -> torch.Tensor:
    code_map = torch.tensor(dynamic_map(), dtype=torch.float32, device=codes.device)
    values = _blocks(code_map[codes.long()], blocksize) * scale.float().unsqueeze(-1)
    return values.reshape(-1)[: codes.numel()].reshape(codes.shape) + offset.float()


def midpoints(sorted_levels: torch.Tensor) -> torch.Tensor:
    """Boundaries between neighbouring levels: a value's nearest level is its bucket among these."""
    return (sorted_levels[:-1] + sorted_levels[1:]) / 2


def _blocks(values: torch.Tensor, blocksize: int) -> torch.Tensor:
    flat = values.reshape(-1).float()
    padding = -flat.numel() % blocksize
    return torch.nn.functional.pad(flat, (0, padding)).reshape(-1, blocksize)


@dataclasses.dataclass(frozen=True)
class NF4Options:
    """`double_quant`: each block's absmax stored in 8 bits (in blocks of `ABSMAX_BLOCKSIZE`), not float32."""

    double_quant: bool = False


class NF4Codec(Codec):
    """NF4 codes packed two to the byte, and each block's absmax (plain float32, or in 8 bits under
    `double_quant`). Round to nearest chooses the codes against the float absmax, as bitsandbytes
    does; the solvers choose them against the absmax as stored (`fit`)."""

    name = "nf4"
    native_kind = 2  # QL_NF4
    onnx_lowering = "level-table"
    options_type = NF4Options

    def validate(self, layout: StorageLayout) -> None:
        if layout.bits != BITS:
            raise ValueError(f"the nf4 codec stores 4-bit codes, got bits={layout.bits}")

    def tensors(self, layout: StorageLayout) -> dict[str, TensorSpec]:
        out, groups = layout.out_features, layout.groups
        specs = {"weight": TensorSpec((out, groups, packing.packed_size(layout.group_length, BITS)), torch.uint8)}
        if layout.options.double_quant:
            absmax_blocks = -(-out * groups // ABSMAX_BLOCKSIZE)
            specs["weight_absmax_codes"] = TensorSpec((out, groups), torch.uint8)
            specs["weight_absmax_scale"] = TensorSpec((absmax_blocks,), torch.float32)
            specs["weight_absmax_offset"] = TensorSpec((1,), torch.float32)
        else:
            specs["weight_absmax"] = TensorSpec((out, groups), torch.float32)
        return specs

    def descriptor(self, layout: StorageLayout) -> str:
        text = super().descriptor(layout)
        return f"{text} absmax_block={ABSMAX_BLOCKSIZE}" if layout.options.double_quant else text

    def native_arguments(self, layout: StorageLayout) -> tuple[str | None, ...]:
        if layout.options.double_quant:
            return (None, None, "weight_absmax_codes", "weight_absmax_scale", "weight_absmax_offset")
        return ("weight_absmax",)

    def native_tables(self) -> dict[str, tuple[float, ...]]:
        return {"levels": NF4_LEVELS, "absmax_map": dynamic_map()}

    # -- round to nearest -----------------------------------------------------------------------

    def quantize(self, layout: StorageLayout, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each block divided by its absmax, then the nearest NF4 level (the codes of
        `bitsandbytes.functional.quantize_4bit(quant_type="nf4")`); a registered `nf4_quantize` op
        computes the same bits in one pass."""
        native = fast_path.run("nf4_quantize", weight, weight, layout.group_length, midpoints(levels()))
        if native is not None:
            codes, absmax = native
        else:
            grouped = grouping.group(weight.float(), layout.group_size)
            absmax = grouped.abs().amax(dim=-1)
            codes = self.encode(layout, grouped, absmax.clamp(min=1e-38).unsqueeze(-1), None)
        return self.store(layout, codes, self.grid(layout, absmax))

    # -- the grid -------------------------------------------------------------------------------

    def levels(self, layout: StorageLayout, device: torch.device | str = "cpu") -> torch.Tensor:
        return levels(device)

    def fits_groups_together(self, layout: StorageLayout) -> bool:
        """Under double quantization: the layer's absmax are compressed together."""
        return layout.options.double_quant

    def fit(
        self, layout: StorageLayout, grouped: torch.Tensor, clip: torch.Tensor | float = 1.0, signed: bool = False
    ) -> GroupParams:
        """Double quantization mixes all groups of a layer: fit them all at once."""
        return self.grid(layout, grouping.clipped_absmax(grouped, clip))

    def grid(self, layout: StorageLayout, scale: torch.Tensor, zero: torch.Tensor | None = None) -> GroupParams:
        """The absmax as stored; under double quantization all absmax of the layer are compressed
        together, so pass them all."""
        if not layout.options.double_quant:
            return GroupParams(scale=scale.float())
        codes, dq_scale, offset = quantize_absmax(scale.float(), ABSMAX_BLOCKSIZE)
        stored = {"weight_absmax_codes": codes, "weight_absmax_scale": dq_scale, "weight_absmax_offset": offset}
        absmax = dequantize_absmax(codes, dq_scale, offset, ABSMAX_BLOCKSIZE)
        return GroupParams(scale=absmax, stored=stored)

    def encode(
        self, layout: StorageLayout, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> torch.Tensor:
        target = values.float() / scale.float() + (zero.float() if zero is not None else 0.0)
        return fast_path.bucketize(target.contiguous(), midpoints(levels(values.device))).to(torch.uint8)

    def decode(
        self, layout: StorageLayout, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
    ) -> torch.Tensor:
        values = levels(codes.device)[codes.long()]
        return (values - (zero.float() if zero is not None else 0.0)) * scale.float()

    # -- stored tensors -------------------------------------------------------------------------

    def store(self, layout: StorageLayout, codes: torch.Tensor, params: GroupParams) -> dict[str, torch.Tensor]:
        stored = {"weight": fast_path.pack(codes.to(torch.uint8), BITS)}
        if layout.options.double_quant:
            stored.update(params.stored)
        else:
            stored["weight_absmax"] = params.scale.float()
        return stored

    def codes(self, layout: StorageLayout, weight: torch.Tensor) -> torch.Tensor:
        return packing.unpack(weight, BITS, layout.group_length)

    def params(self, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> GroupParams:
        if not layout.options.double_quant:
            return GroupParams(scale=stored["weight_absmax"].float())
        absmax = dequantize_absmax(
            stored["weight_absmax_codes"],
            stored["weight_absmax_scale"],
            stored["weight_absmax_offset"],
            ABSMAX_BLOCKSIZE,
        )
        return GroupParams(scale=absmax)

    def gguf_blocks(self, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> GGUFBlocks:
        raise NotExactInGGUF(
            "NF4 codes index 16 normal-quantile levels, which no GGUF type stores (IQ4_NL's 16 levels are others)"
        )

    def integer_grid(self, layout: StorageLayout, stored: dict[str, torch.Tensor]) -> IntegerGrid:
        raise NotAnIntegerGrid(
            "NF4 codes index 16 normal-quantile levels, not a uniform integer grid; quantize it with custom_bits "
            "(4-bit, symmetric) or int8 to export it"
        )


NF4 = register_codec(NF4Codec())
