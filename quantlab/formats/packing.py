"""Bit packing of integer codes of any width from 1 to 8 bits.

Eight codes of `bits` bits fill exactly `bits` bytes, so the last dimension is cut into
chunks of eight codes, each chunk is assembled into one int64 and written out as `bits`
little-endian bytes. The first code of a chunk lands in the lowest bits. Rows whose length
is not a multiple of eight are padded with zero codes; `unpack` takes the true length.
"""

import torch

MIN_BITS = 1
MAX_BITS = 8


def packed_size(num_codes: int, bits: int) -> int:
    """Bytes that `num_codes` codes of `bits` bits take once packed (rows padded to 8 codes)."""
    _check_bits(bits)
    return -(-num_codes // 8) * bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (`0 <= code < 2**bits`) along the last dimension into uint8.

    The definition; `quantlab.kernels.quantize.pack` runs a bit-identical native op when one
    is registered for the codes' device.
    """
    _check_bits(bits)
    *lead, length = codes.shape
    padded = -(-length // 8) * 8
    chunks = codes.to(torch.int64)
    if padded != length:
        chunks = torch.nn.functional.pad(chunks, (0, padded - length))
    chunks = chunks.reshape(*lead, padded // 8, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (chunks << shifts).sum(dim=-1, keepdim=True)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    packed = (words >> byte_shifts) & 0xFF
    return packed.to(torch.uint8).reshape(*lead, padded // 8 * bits)


def unpack(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 bytes back to `length` codes (uint8) per row."""
    _check_bits(bits)
    *lead, nbytes = packed.shape
    if nbytes % bits:
        raise ValueError(f"{nbytes} packed bytes per row is not a multiple of {bits} bits")
    chunks = packed.to(torch.int64).reshape(*lead, nbytes // bits, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (chunks << byte_shifts).sum(dim=-1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (words >> shifts) & ((1 << bits) - 1)
    return codes.to(torch.uint8).reshape(*lead, nbytes // bits * 8)[..., :length]


def _check_bits(bits: int) -> None:
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bit width must be between {MIN_BITS} and {MAX_BITS}, got {bits}")
