"""GGUF block layouts in bytes (ggml-common.h): `GGUFBlocks` numbers → the rows a GGUF file stores.

Every block covers 32 weights of a row and starts with its float16 `d`:
- Q4_0: `d`, then 16 bytes; byte j holds code j in its low nibble and code j + 16 in its high
  nibble. Value `(q - 8) * d`.
- Q4_1: `d`, the float16 minimum `m`, then the 16 code bytes of Q4_0. Value `q * d + m`.
- Q8_0: `d`, then the 32 codes as signed bytes. Value `q * d`.
- IQ4_NL: `d`, then the 16 code bytes of Q4_0, indices into `kvalues_iq4nl`. Value `kvalues[q] * d`.

Pure functions on tensors; the result is a numpy `uint8` array `[rows, bytes per row]`, what
`gguf.GGUFWriter.add_tensor(..., raw_dtype=...)` takes for a quantized tensor.
"""

import numpy as np
import torch

from quantlab.formats.codec import GGUF_BLOCK, GGUFBlocks

BLOCK_BYTES = {
    "Q4_0": 2 + GGUF_BLOCK // 2,
    "Q4_1": 4 + GGUF_BLOCK // 2,
    "Q8_0": 2 + GGUF_BLOCK,
    "IQ4_NL": 2 + GGUF_BLOCK // 2,
}


def pack(blocks: GGUFBlocks) -> np.ndarray:
    """The bytes of `blocks`, `[rows, in // 32 * block bytes]`."""
    rows, columns = blocks.codes.shape
    if columns % GGUF_BLOCK:
        raise ValueError(f"rows of {columns} weights do not split into blocks of {GGUF_BLOCK}")
    count = columns // GGUF_BLOCK
    codes = blocks.codes.reshape(rows, count, GGUF_BLOCK)
    fields = [_half_bytes(blocks.scale, rows, count)]
    if blocks.type == "Q4_1":
        if blocks.min is None:
            raise ValueError("Q4_1 blocks need their minimum m")
        fields.append(_half_bytes(blocks.min, rows, count))
    if blocks.type in ("Q4_0", "Q4_1", "IQ4_NL"):
        fields.append(nibbles(codes))
    elif blocks.type == "Q8_0":
        fields.append(codes.to(torch.int8).view(torch.uint8))
    else:
        raise ValueError(f"no block layout for GGUF type {blocks.type!r}; known: {', '.join(BLOCK_BYTES)}")
    packed = torch.cat(fields, dim=-1)
    return packed.reshape(rows, count * BLOCK_BYTES[blocks.type]).contiguous().numpy()


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes `[..., 32]` → 16 bytes: code j in the low nibble of byte j, code j + 16 in its high nibble."""
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("4-bit block codes must lie in 0..15")
    codes = codes.to(torch.uint8)
    half = GGUF_BLOCK // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def _half_bytes(values: torch.Tensor, rows: int, count: int) -> torch.Tensor:
    """Float16 numbers `[rows, count]` → their little-endian bytes `[rows, count, 2]`."""
    half = values.to(torch.float16).reshape(rows, count, 1).contiguous()
    return half.view(torch.uint8)
