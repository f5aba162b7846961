"""Bool masks packed eight to a byte (first element in the lowest bit), and back."""

import torch

from quantlab.formats import fast_path, packing


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Any-shape bool mask → 1-D uint8 of `ceil(numel / 8)` bytes, in row-major order."""
    flat = mask.reshape(1, -1).to(torch.uint8)
    return fast_path.pack(flat, 1).reshape(-1)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `numel` bits as a 1-D bool tensor."""
    if packed.numel() * 8 < numel:
        raise ValueError(f"{packed.numel()} bytes hold {packed.numel() * 8} bits, fewer than the {numel} asked")
    return packing.unpack(packed.reshape(1, -1), 1, numel).reshape(-1).bool()
