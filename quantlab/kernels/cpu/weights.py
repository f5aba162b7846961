"""Describing a quantized layer's stored tensors to the native kernels, without copying them.

The kernels read the checkpoint layout as is (codes `[out, groups, bytes]` and per-group
scales), so nothing is repacked: a description is a C struct of pointers into the layer's
own buffers, filled from the arguments the torch operators take (`ops.weight_arguments`: the
layout's descriptor and the stored tensors), so both paths describe a weight one way. Any layer
whose codec has a native kernel kind (`Codec.native_kind`) is described the same way, whatever
its class.
A description is cached per layer in a weak dictionary (never on the module, so copying or
pickling a model is unaffected) and rebuilt when any stored tensor is replaced, modified in
place (its version counter moves), moved or cast.
"""

import ctypes
import weakref

import torch

from quantlab.formats.codec import native_codecs
from quantlab.formats.layout import StorageLayout, parse_descriptor
from quantlab.kernels.cpu.native import QuantlabCpuWeight
from quantlab.kernels.cpu.ops import weight_arguments

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class NativeWeight:
    """A layer's `QuantlabCpuWeight` plus the tensors its pointers refer to (kept alive here)."""

    def __init__(self, struct: QuantlabCpuWeight, tensors: list[torch.Tensor]) -> None:
        self.struct = struct
        self.pointer = ctypes.byref(struct)
        self.tensors = tensors
        self.out_features = int(struct.n)
        self.in_features = int(struct.k)
        self.sources: tuple = ()

    def still_describes(self, module: torch.nn.Module) -> bool:
        """True while the layer holds the same stored tensors, unmodified (checked on every call: cheap)."""
        buffers = module._buffers
        for name, tensor, version, pointer in self.sources:
            current = buffers[name] if name in buffers else getattr(module, name)
            if current is not tensor or tensor._version != version or tensor.data_ptr() != pointer:
                return False
        return True


_cache: "weakref.WeakKeyDictionary[torch.nn.Module, NativeWeight]" = weakref.WeakKeyDictionary()
MIN_BITS = 2  # narrower codes (a 1-bit affine layout) run on the reference kernel


def supported(format: str) -> bool:
    """True when `format` (a layout codec) is one the native kernels decode."""
    return format in native_codecs()


def describable(layout: StorageLayout) -> bool:
    """True when the native kernels decode this layout (its codec has a native kind; 2 to 8 bits)."""
    return layout.codec_object.native_kind is not None and layout.bits >= MIN_BITS


def native_weight(module: torch.nn.Module) -> NativeWeight:
    """The (cached) description of `module`'s stored tensors."""
    cached = _cache.get(module)
    if cached is not None and cached.still_describes(module):
        return cached
    described = describe_arguments(*weight_arguments(module))
    described.sources = tuple((n, t, t._version, t.data_ptr()) for n, t in module.stored_tensors().items())
    _cache[module] = described
    return described


def _readable(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the kernels read it: contiguous, on CPU, float32/16/bf16 if floating."""
    tensor = tensor.detach()
    if tensor.is_floating_point() and tensor.dtype not in _DTYPE_CODES:
        tensor = tensor.float()
    return tensor.contiguous()


def _set_scale(struct: QuantlabCpuWeight, keep: list, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
    scale = _readable(scale)
    struct.scale, struct.scale_dtype = scale.data_ptr(), _DTYPE_CODES[scale.dtype]
    keep.append(scale)
    if zero is not None:
        zero = _readable(zero)
        struct.zero, struct.zero_dtype = zero.data_ptr(), _DTYPE_CODES[zero.dtype]
        keep.append(zero)


def describe_arguments(
    descriptor: str,
    codes: torch.Tensor,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    absmax_codes: torch.Tensor | None = None,
    absmax_scale: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
) -> NativeWeight:
    """The description of a weight given as `ops.weight_arguments` gives it (what the C++ operators'
    `describe` builds); no module and no cache, so a traced call is a pure function of its tensors."""
    layout = parse_descriptor(descriptor)
    codec = layout.codec_object
    kind, bits, in_features, group_size = codec.native_kind, layout.bits, layout.in_features, layout.group_size
    absmax_block, zero_const = layout.absmax_block, layout.zero
    codes = _readable(codes)
    struct = QuantlabCpuWeight()
    struct.codes = codes.data_ptr()
    struct.n, struct.k, struct.groups, struct.group_bytes = codes.shape[0], in_features, codes.shape[1], codes.shape[2]
    struct.group_size, struct.group_codes = group_size, codes.shape[2] * 8 // bits
    struct.bits, struct.kind, struct.zero_const = bits, kind, zero_const
    keep = [codes]
    if codec.native_table_argument:  # the layer's own level table, where other codecs pass zero points
        table = zero.detach().float().cpu().tolist()
        struct.levels[: len(table)] = table
        zero = None
    if scale is not None:
        _set_scale(struct, keep, scale, zero)
    tables = codec.native_tables()
    if "levels" in tables:
        struct.levels[:] = tables["levels"]
    if absmax_codes is not None:
        absmax_codes, absmax_scale = _readable(absmax_codes), _readable(absmax_scale).float()
        struct.absmax_codes, struct.absmax_scale = absmax_codes.data_ptr(), absmax_scale.data_ptr()
        struct.absmax_offset = float(absmax_offset.float().item())
        struct.absmax_block = absmax_block
        struct.absmax_map[:] = tables["absmax_map"]
        keep += [absmax_codes, absmax_scale]
    return NativeWeight(struct, keep)
