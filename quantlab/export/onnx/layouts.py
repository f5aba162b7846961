"""quantlab's stored tensors rearranged into onnxruntime's operator layouts, without re-quantizing.

`com.microsoft::MatMulNBits` (onnxruntime 1.31, CPU) takes codes packed along K in blocks of
16 to 256 weights (2, 4 or 8 bits; low bits first, the order of `quantlab.formats.packing`),
float32 scales `[N, blocks]` and either no zero point (then `2**(bits-1)`), float zero points
(2 and 4 bits only) or uint8 ones. `com.microsoft::MatMulBnb4` takes NF4 codes of the
flattened `[N, K]` weight, two per byte with the FIRST code in the HIGH nibble (bitsandbytes'
order; quantlab packs the first code in the low nibble), and one float absmax per block.

A quantlab group that is larger than onnxruntime's largest block (per-channel groups, int8
groups of 512+) is cut into several blocks that repeat the group's scale: the codes and every
dequantized weight stay identical, only the layout changes.
"""

from dataclasses import dataclass

import torch

from quantlab.formats import fast_path, grouping

ORT_BLOCK_SIZES = (16, 32, 64, 128, 256)
MATMUL_NBITS_BITS = (2, 4, 8)
FLOAT_ZERO_POINT_BITS = (2, 4)  # MatMulNBits accepts float zero points only at these widths


@dataclass
class NBitsWeight:
    """Inputs and attributes of one `MatMulNBits` node."""

    packed: torch.Tensor  # uint8 [N, blocks, block_size * bits / 8]
    scales: torch.Tensor  # float32 [N, blocks]
    zero_points: torch.Tensor | None  # float32 [N, blocks], or None for the default 2**(bits-1)
    bits: int
    block_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]


@dataclass
class Bnb4Weight:
    """Inputs and attributes of one `MatMulBnb4` node (NF4)."""

    packed: torch.Tensor  # uint8 [(N * K + 1) // 2], first code of each pair in the high nibble
    absmax: torch.Tensor  # float32 [N * K / block_size]
    block_size: int
    in_features: int
    out_features: int


def supports_matmul_nbits(bits: int, has_float_zero: bool) -> bool:
    if bits not in MATMUL_NBITS_BITS:
        return False
    return not has_float_zero or bits in FLOAT_ZERO_POINT_BITS


def matmul_nbits_weight(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, in_features: int
) -> NBitsWeight:
    """Grouped unsigned codes `[N, G, group_size]` (dequantized as `(q - zero) * scale`, zero
    `2**(bits-1)` when None) in `MatMulNBits` layout."""
    if not supports_matmul_nbits(bits, zero is not None):
        zeros = "float zeros" if zero is not None else "the default zero point"
        raise ValueError(f"MatMulNBits cannot hold {bits}-bit codes with {zeros}")
    block_size = nbits_block_size(codes.shape[1], codes.shape[2], in_features, bits)
    codes, index = reblock(codes, in_features, block_size)
    return NBitsWeight(
        packed=fast_path.pack(codes, bits),
        scales=scale.float()[:, index],
        zero_points=None if zero is None else zero.float()[:, index],
        bits=bits,
        block_size=block_size,
        in_features=in_features,
    )


def nbits_block_size(groups: int, group_size: int, in_features: int, bits: int) -> int:
    """The onnxruntime block size for groups of `group_size` weights.

    A supported group size is kept. A larger one needs blocks that tile each group: with
    several groups per row the largest supported power of two dividing the group size; with
    one group per row (per channel, any K) the block size that stores the fewest bytes.
    """
    if group_size in ORT_BLOCK_SIZES:
        return group_size
    if groups > 1:
        return max(size for size in ORT_BLOCK_SIZES if group_size % size == 0)

    def stored_bytes(size: int) -> int:
        return -(-in_features // size) * (size * bits // 8 + 4)

    return min(reversed(ORT_BLOCK_SIZES), key=stored_bytes)


def reblock(codes: torch.Tensor, in_features: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes `[N, G, group_size]` as `[N, blocks, block_size]`, and each block's group index."""
    group_size = codes.shape[2]
    if group_size == block_size:
        return codes, torch.arange(codes.shape[1])
    rows = grouping.ungroup(codes, in_features)
    blocks = grouping.group(rows, block_size)
    index = torch.arange(blocks.shape[1]) * block_size // group_size
    return blocks, index


def bnb4_block_size(in_features: int, blocksize: int) -> int | None:
    """A `MatMulBnb4` block size that tiles quantlab's NF4 blocks and the rows, or None.

    MatMulBnb4 cuts the flattened `[N, K]` weight into blocks, so a block must not cross a
    row end: it has to divide K as well as quantlab's blocksize.
    """
    fitting = [size for size in ORT_BLOCK_SIZES if in_features % size == 0 and blocksize % size == 0]
    return max(fitting) if fitting else None


def matmul_bnb4_weight(codes: torch.Tensor, absmax: torch.Tensor, in_features: int) -> Bnb4Weight:
    """NF4 codes `[N, blocks, blocksize]` (indices into the NF4 table) and float absmax `[N, blocks]`."""
    block_size = bnb4_block_size(in_features, codes.shape[2])
    if block_size is None:
        raise ValueError(f"MatMulBnb4 has no block size that tiles K={in_features} and blocksize {codes.shape[2]}")
    codes, index = reblock(codes, in_features, block_size)
    flat = codes.reshape(-1, 2).to(torch.uint8)
    return Bnb4Weight(
        packed=(flat[:, 0] << 4) | flat[:, 1],
        absmax=absmax.float()[:, index].reshape(-1),
        block_size=block_size,
        in_features=in_features,
        out_features=codes.shape[0],
    )
