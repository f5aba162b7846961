"""Native quantize ops for quantize-on-load: the codecs' round-to-nearest in one pass per row.

Each function returns exactly what the torch definition in the codec returns (bit-identical
codes and scales; see `csrc/quantize.c`), or None when the native library is unavailable or the
input is not a CPU tensor, and the codec then runs the torch code. They are registered in the
quantize-op table (`quantlab.formats.fast_path`) for "cpu". The torch version runs many small
multi-threaded ops, each of which can stall on a busy machine; this is one call per layer
(timings in benchmarks/RESULTS.md).
"""

import torch

from quantlab.formats.fast_path import register_quantize_op
from quantlab.kernels.cpu import native

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _rows(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() == 0:
        return None
    weight = weight.detach().float()
    return weight if weight.stride(1) == 1 else weight.contiguous()


@register_quantize_op("affine_quantize", "cpu")
def affine_quantize(
    weight: torch.Tensor, bits: int, group_size: int | None, symmetric: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(codes [out, groups, size] uint8, scale, zero or None), as the affine codec's round to nearest."""
    lib = native.library()
    rows = _rows(weight)
    if lib is None or rows is None or scale_dtype not in _DTYPE_CODES:
        return None
    out_features, in_features = rows.shape
    size = group_size or in_features
    groups = -(-in_features // size)
    codes = torch.empty(out_features, groups, size, dtype=torch.uint8)
    scale = torch.empty(out_features, groups, dtype=scale_dtype)
    zero = None if symmetric else torch.empty(out_features, groups, dtype=scale_dtype)
    status = lib.ql_quantize_affine(
        rows.data_ptr(), out_features, in_features, rows.stride(0), size, bits, int(symmetric),
        _DTYPE_CODES[scale_dtype], codes.data_ptr(), scale.data_ptr(), zero.data_ptr() if zero is not None else None,
        torch.get_num_threads(),
    )  # fmt: skip
    return (codes, scale, zero) if status == 0 else None


@register_quantize_op("nf4_quantize", "cpu")
def nf4_quantize(
    weight: torch.Tensor, blocksize: int, midpoints: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes [out, blocks, blocksize] uint8, absmax [out, blocks] float32), as the nf4 codec's round to nearest."""
    lib = native.library()
    rows = _rows(weight)
    if lib is None or rows is None:
        return None
    out_features, in_features = rows.shape
    blocks = -(-in_features // blocksize)
    codes = torch.empty(out_features, blocks, blocksize, dtype=torch.uint8)
    absmax = torch.empty(out_features, blocks, dtype=torch.float32)
    midpoints = midpoints.float().contiguous()
    status = lib.ql_quantize_nf4(
        rows.data_ptr(), out_features, in_features, rows.stride(0), blocksize, midpoints.data_ptr(),
        codes.data_ptr(), absmax.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return (codes, absmax) if status == 0 else None


@register_quantize_op("pack", "cpu")
def pack(codes: torch.Tensor, bits: int) -> torch.Tensor | None:
    """Packed bytes, as `formats.packing.pack`."""
    lib = native.library()
    if lib is None or codes.device.type != "cpu" or codes.dtype != torch.uint8 or codes.dim() == 0:
        return None
    *lead, length = codes.shape
    codes = codes.contiguous()
    out = torch.empty(*lead, -(-length // 8) * bits, dtype=torch.uint8)
    rows = codes.numel() // length if length else 0
    if rows and lib.ql_pack(codes.data_ptr(), rows, length, bits, out.data_ptr()) != 0:
        return None
    return out


@register_quantize_op("count_nonfinite", "cpu")
def count_nonfinite(weight: torch.Tensor) -> int | None:
    """How many NaN/Inf values `weight` holds (one pass, no temporaries), or None without the library."""
    lib = native.library()
    if lib is None or weight.device.type != "cpu" or not weight.is_floating_point():
        return None
    values = weight.detach()
    if values.dtype != torch.float32:
        values = values.float()  # a half value is finite exactly when its float32 value is
    values = values.contiguous()
    return int(lib.ql_count_nonfinite(values.data_ptr(), values.numel(), torch.get_num_threads()))


@register_quantize_op("bucketize", "cpu")
def bucketize(values: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor | None:
    """`torch.bucketize(values, boundaries, out_int32=True)` for sorted float32 boundaries."""
    lib = native.library()
    if lib is None or values.device.type != "cpu" or values.dtype != torch.float32:
        return None
    values, boundaries = values.contiguous(), boundaries.float().contiguous()
    out = torch.empty(values.shape, dtype=torch.int32)
    lib.ql_bucketize(values.data_ptr(), values.numel(), boundaries.data_ptr(), boundaries.numel(), out.data_ptr())
    return out


@register_quantize_op("offset_to_signed", "cpu")
def offset_to_signed(codes: torch.Tensor) -> torch.Tensor | None:
    """uint8 codes `q + 128` as int8 `q`, converted in place (one native pass), or None."""
    lib = native.library()
    if lib is None or codes.device.type != "cpu" or codes.dtype != torch.uint8 or not codes.is_contiguous():
        return None
    lib.ql_offset_to_signed(codes.data_ptr(), codes.numel())
    return codes.view(torch.int8)
