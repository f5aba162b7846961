"""Lowering one quantized Linear layer into ONNX nodes that compute with its stored weights.

The exported graph holds a placeholder node per quantized layer (see `placeholder.py`); a
lowering replaces it by onnxruntime operators fed with the layer's own codes and scales.
A layer is lowered by the lowering its codec names (`Codec.onnx_lowering`: "integer-grid",
"level-table"; `codec_lowerings.py`), which reads bits, group size, zero points and levels
from `layer.layout`; a codec that names none gets the fallback `lower_dequantized` (its float
weight and a MatMul), so a layer of any registered codec exports. A plugin may still override
that for its classes with `register_onnx_lowering(MyLinear)` (looked up first, along the class's
MRO); a layer that declares no storage layout and registers no lowering is refused, naming it.

Three kinds of nodes are available to a lowering:

- `matmul_nbits`: `com.microsoft::MatMulNBits`, onnxruntime's fused low-bit matmul.
- `matmul_bnb4`: `com.microsoft::MatMulBnb4`, the NF4/FP4 matmul of bitsandbytes' format.
- the fallback, `dequantize_matmul`: standard ONNX operators that compute a float weight and
  multiply. The grid lowerings build it from quantlab's packed codes (unpack, `(q - zero) * scale`
  or a table lookup), so the file keeps the packed bytes (3 bits per 3-bit weight); a codec with
  no lowering stores its dequantized weight. onnxruntime folds the subgraph into a float weight
  when it loads the session, so it runs at float speed and float memory.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import onnx_ir as ir
import torch

from quantlab.export.onnx.errors import ExportError
from quantlab.export.onnx.layouts import Bnb4Weight, NBitsWeight
from quantlab.nn import QuantizedLinear, rotation
from quantlab.nn.layouts import declared_layout

MS_DOMAIN = "com.microsoft"
NF4_QUANT_TYPE = 1
ZERO_CORRECTED_BITS = (4,)  # widths whose float zero points are moved out of MatMulNBits

Lowering = Callable[["LayerLowering", QuantizedLinear], ir.Value]
_LOWERINGS: dict[type, Lowering] = {}  # overrides by layer class
_GRID_LOWERINGS: dict[str, Lowering] = {}  # by `Codec.onnx_lowering`


def register_onnx_lowering(module_class: type) -> Callable[[Lowering], Lowering]:
    """Decorator: `fn(ctx, module) -> ir.Value` lowers layers of `module_class` (and subclasses),
    in place of the lowering of their layout's codec."""

    def decorator(fn: Lowering) -> Lowering:
        _LOWERINGS[module_class] = fn
        return fn

    return decorator


def register_grid_lowering(kind: str) -> Callable[[Lowering], Lowering]:
    """Decorator: `fn(ctx, module) -> ir.Value` lowers every layer whose codec's `onnx_lowering` is `kind`."""

    def decorator(fn: Lowering) -> Lowering:
        _GRID_LOWERINGS[kind] = fn
        return fn

    return decorator


def lowering_for(name: str, module: QuantizedLinear) -> Lowering:
    for cls in type(module).__mro__:
        if cls in _LOWERINGS:
            return _LOWERINGS[cls]
    layout = declared_layout(module)
    if layout is not None:
        return _GRID_LOWERINGS.get(layout.codec_object.onnx_lowering, lower_dequantized)
    raise ExportError(
        f"{name}: no ONNX lowering for quantized layer type {type(module).__name__} (it declares no storage "
        f"layout); register one with quantlab.export.register_onnx_lowering({type(module).__name__}), "
        f"or dequantize this layer before export"
    )


def lower_dequantized(ctx: "LayerLowering", module: QuantizedLinear) -> ir.Value:
    """The fallback of a codec with no lowering of its own: its dequantized weight (in the activation
    dtype) as an initializer, and a MatMul."""
    weight = ctx.initializer("weight", module.dequantize_stored(ctx.activation_dtype()))
    return ctx.dequantize_matmul(weight, module)


@dataclass
class LayerLowering:
    """Builds the nodes of one layer: `x` is the layer input, names start with the layer name.

    Initializers go straight into `graph`; `created` is shared by all layers, so a layer called
    twice (shared weights) reuses its initializers instead of storing them again.
    """

    name: str
    x: ir.Value
    graph: ir.Graph
    created: dict[str, ir.Value]
    accuracy_level: int = 0  # MatMulNBits' attribute: 0 keeps float activations, 4 quantizes them to int8
    tape: ir.tape.Tape = field(default_factory=ir.tape.Tape)
    operator: str = ""  # the operator chosen, for the export summary

    @property
    def dtype(self) -> ir.DataType:
        return self.x.dtype

    # -- building blocks -----------------------------------------------------------------

    def initializer(self, suffix: str, tensor: torch.Tensor) -> ir.Value:
        return self.shared_initializer(f"{self.name}.{suffix}", tensor)

    def shared_initializer(self, name: str, tensor: torch.Tensor) -> ir.Value:
        """An initializer under a graph-wide name: the first tensor registered under it is used."""
        if name in self.created:
            return self.created[name]
        if name in self.graph.initializers:
            raise ExportError(f"{self.name}: the exported graph already has an initializer named {name!r}")
        data = ir.tensor(tensor.detach().contiguous().cpu(), name=name)
        value = ir.Value(name=name, shape=ir.Shape(data.shape), type=ir.TensorType(data.dtype), const_value=data)
        self.graph.register_initializer(value)
        self.created[name] = value
        return value

    def constant(self, suffix: str, values: list, dtype: torch.dtype) -> ir.Value:
        return self.initializer(suffix, torch.tensor(values, dtype=dtype))

    def op(self, op_type: str, inputs: list[ir.Value | None], **attributes) -> ir.Value:
        while inputs and inputs[-1] is None:
            inputs = inputs[:-1]
        domain = MS_DOMAIN if op_type in ("MatMulNBits", "MatMulBnb4") else ""
        return self.tape.op(op_type, inputs, attributes or None, domain=domain)

    def activation_dtype(self) -> torch.dtype:
        dtypes = {ir.DataType.FLOAT: torch.float32, ir.DataType.FLOAT16: torch.float16}
        dtypes[ir.DataType.BFLOAT16] = torch.bfloat16
        if self.dtype not in dtypes:
            raise ExportError(f"{self.name}: cannot export a quantized layer with {self.dtype} activations")
        return dtypes[self.dtype]

    def bias(self, module: QuantizedLinear) -> ir.Value | None:
        if module.bias is None:
            return None
        return self.initializer("bias", module.bias.to(self.activation_dtype()))

    def rotate_input(self, module: QuantizedLinear) -> None:
        """Make `x` the layer's rotated input `x R` (`quantlab.nn.rotation`): per block of inputs, the two
        Hadamard factors as MatMuls, so the lowering that follows multiplies it by the stored codes of `W R`."""
        block = module.input_rotation
        left, right = rotation.factors(block)
        dtype = self.activation_dtype()
        name = str(dtype).removeprefix("torch.")
        shape = self.constant("rotation_shape", [-1, module.in_features // block, left, right], torch.int64)
        grouped = self.op("Reshape", [self.x, shape])
        right_factor = self.shared_initializer(f"hadamard_{right}_{name}", rotation.hadamard(right, dtype))
        grouped = self.op("MatMul", [grouped, right_factor])
        left_factor = self.shared_initializer(f"hadamard_{left}_{name}", rotation.hadamard(left, dtype))
        grouped = self.op("MatMul", [left_factor, grouped])
        rotated = self.op("Reshape", [grouped, self.op("Shape", [self.x])])
        rotated.type, rotated.shape = self.x.type, self.x.shape  # what the lowerings read of their input
        self.x = rotated

    # -- the three ways to compute a layer ---------------------------------------------------

    def matmul_nbits(self, weight: NBitsWeight, module: QuantizedLinear) -> ir.Value:
        """`MatMulNBits`; 4-bit float zero points are folded out of the kernel (see `zero_point_correction`)."""
        self.operator = "MatMulNBits"
        dtype = self.activation_dtype()
        zero = weight.zero_points
        corrected = zero is not None and weight.bits in ZERO_CORRECTED_BITS
        y = self.op(
            "MatMulNBits",
            [
                self.x,
                self.initializer("qweight", weight.packed),
                self.initializer("scales", weight.scales.to(dtype)),
                None if zero is None or corrected else self.initializer("zero_points", zero.to(dtype)),
                None,  # g_idx (deprecated)
                self.bias(module),
            ],
            K=weight.in_features,
            N=weight.out_features,
            bits=weight.bits,
            block_size=weight.block_size,
            **({"accuracy_level": self.accuracy_level} if self.accuracy_level else {}),
        )
        return self.op("Sub", [y, self.zero_point_correction(weight)]) if corrected else y

    def zero_point_correction(self, weight: NBitsWeight) -> ir.Value:
        """`x @ W_shift.T` with `W_shift[n, k] = (zero - 2**(bits-1)) * scale` of k's block.

        onnxruntime's CPU kernel has a fast path for 4-bit codes with the default or uint8 zero
        points only; with float zero points it dequantizes the whole weight on every call (timings
        in benchmarks/RESULTS.md). Since
        `(q - z) * s = (q - d) * s - (z - d) * s` for the default zero `d`, the layer runs on the
        fast path and subtracts the second term: the block sums of `x` (`x @ E`, E the 0/1
        block-membership matrix, shared by layers of equal K) times `(z - d) * s`, two matmuls
        of width `blocks`, about 1/60 of the layer's work at blocks of 64.
        """
        in_features, block_size = weight.in_features, weight.block_size
        blocks = weight.scales.shape[1]
        dtype = self.activation_dtype()
        membership = torch.zeros(in_features, blocks, dtype=dtype)
        membership[torch.arange(in_features), torch.arange(in_features) // block_size] = 1
        shift = (weight.zero_points.float() - float(1 << (weight.bits - 1))) * weight.scales.float()
        block_sums = self.op(
            "MatMul", [self.x, self.shared_initializer(f"block_sums_{in_features}_{block_size}", membership)]
        )
        return self.op("MatMul", [block_sums, self.initializer("zero_shift", shift.t().to(dtype))])

    def matmul_bnb4(self, weight: Bnb4Weight, module: QuantizedLinear) -> ir.Value:
        self.operator = "MatMulBnb4"
        y = self.op(
            "MatMulBnb4",
            [
                self.x,
                self.initializer("qweight", weight.packed),
                self.initializer("absmax", weight.absmax.to(self.activation_dtype())),
            ],
            K=weight.in_features,
            N=weight.out_features,
            block_size=weight.block_size,
            quant_type=NF4_QUANT_TYPE,
        )
        return self.add_bias(y, module)

    def dequantize_matmul(self, weight: ir.Value, module: QuantizedLinear) -> ir.Value:
        """The fallback: `x @ weight.T` with `weight` a float `[N, K]` value built by the lowering."""
        self.operator = "fallback"
        y = self.op("MatMul", [self.x, self.op("Transpose", [weight], perm=[1, 0])])
        return self.add_bias(y, module)

    def add_bias(self, y: ir.Value, module: QuantizedLinear) -> ir.Value:
        bias = self.bias(module)
        return y if bias is None else self.op("Add", [y, bias])

    # -- pieces of a dequantization subgraph (the fallback) ------------------------------------

    def unpacked_codes(self, packed: torch.Tensor, bits: int, group_size: int) -> ir.Value:
        """int32 codes `[N, G, group_size]` from `quantlab.formats.packing` bytes `[N, G, bytes]`.

        Every run of `bits` bytes holds eight codes, code `i` starting at bit `i * bits` (low
        bits first). A code spans at most two bytes, so it is `(lo + 256 * hi) >> shift & mask`
        with `lo`, `hi` gathered from the run: small integers only (onnxruntime's int64
        ReduceSum rounds through double, so joining the run into one 56-bit word is not exact).
        """
        stored = self.initializer("qweight", packed)
        out_features, groups, nbytes = packed.shape
        if bits == 8:
            return self.op("Cast", [stored], to=ir.DataType.INT32)
        chunks = nbytes // bits
        shape = self.constant("chunk_shape", [out_features, groups, chunks, bits], torch.int64)
        runs = self.op("Cast", [self.op("Reshape", [stored, shape])], to=ir.DataType.INT32)
        starts = [i * bits for i in range(8)]
        low = self.op("Gather", [runs, self.constant("low_byte", [s // 8 for s in starts], torch.int64)], axis=3)
        high_index = [min(s // 8 + 1, bits - 1) for s in starts]  # the last code never needs a next byte
        high = self.op("Gather", [runs, self.constant("high_byte", high_index, torch.int64)], axis=3)
        pairs = self.op("Add", [low, self.op("Mul", [high, self.constant("byte", [256], torch.int32)])])
        shifted = self.op("Div", [pairs, self.constant("code_shift", [1 << (s % 8) for s in starts], torch.int32)])
        codes = self.op("BitwiseAnd", [shifted, self.constant("code_mask", [(1 << bits) - 1], torch.int32)])
        flat_shape = self.constant("code_shape", [out_features, groups, chunks * 8], torch.int64)
        codes = self.op("Reshape", [codes, flat_shape])
        if chunks * 8 == group_size:
            return codes
        return self.slice_last(codes, group_size, "group")

    def to_float(self, value: ir.Value) -> ir.Value:
        return self.op("Cast", [value], to=self.dtype)

    def grouped_param(self, suffix: str, tensor: torch.Tensor) -> ir.Value:
        """A `[N, G]` scale or zero as stored (its own dtype), cast to float `[N, G, 1]`."""
        stored = self.initializer(suffix, tensor)
        return self.op("Unsqueeze", [self.to_float(stored), self.constant(f"{suffix}_axis", [-1], torch.int64)])

    def ungroup(self, grouped: ir.Value, out_features: int, in_features: int) -> ir.Value:
        """`[N, G, group_size]` → `[N, in_features]`, dropping the padding of the last group."""
        rows = self.op("Reshape", [grouped, self.constant("row_shape", [out_features, -1], torch.int64)])
        return self.slice_last(rows, in_features, "row")

    def slice_last(self, value: ir.Value, length: int, what: str) -> ir.Value:
        starts = self.constant(f"{what}_start", [0], torch.int64)
        ends = self.constant(f"{what}_end", [length], torch.int64)
        return self.op("Slice", [value, starts, ends, self.constant(f"{what}_axis", [-1], torch.int64)])
