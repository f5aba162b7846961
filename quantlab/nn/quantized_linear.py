"""`QuantizedLinear`: the base every method's quantized Linear layer derives from.

A method's layer declares one storage layout (`layout_for`: codec, bits, group size, the
tensors it stores; see `quantlab.formats.layout`), which kernels, ONNX lowerings, sparse
storage, load checks and the solvers all read. How a float weight becomes those tensors is
the config's solver (round-to-nearest by default: `quantize_weight`; data-free and
calibrated solvers in `quantlab.solvers`), used both by `quantlab.quantize` and tensor by
tensor while transformers loads a checkpoint. Everything stored is a buffer, so nothing quantized is ever trainable,
and the codes are stored as `weight` with three dimensions `[out, groups, bytes]`: a
process that loads the checkpoint without quantlab sees a shape mismatch and stops, instead
of running integer codes as float weights.

The forward pass asks the kernel table for the fastest kernel of this layer's storage
format on the input's device; the reference kernel is dequantize-then-matmul.

A layer named in the config's `rotate_inputs` rotates its input by a Hadamard matrix `R` first
(`quantlab.nn.rotation`, `input_rotation` is the block size): its codes are those of `W R`
(`dequantize_stored`), and `dequantize_weight` gives `W` back, the weight of the layer's own input.
"""

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from quantlab.config import QuantlabConfig
from quantlab.errors import QuantizationError
from quantlab.formats.layout import GroupParams, StorageLayout
from quantlab.kernels import select_kernel
from quantlab.nn.rotation import input_rotation_block, rotate, rotate_square
from quantlab.nn.stored import StoredTensorsModule

StorageSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]

if TYPE_CHECKING:
    from quantlab.solvers import InputStats, Solver


class QuantizedLinear(StoredTensorsModule):
    """A Linear layer whose weight is stored quantized; `bias` stays a float parameter."""

    config_class: ClassVar[type[QuantlabConfig]]
    # 8: the native CPU kernel rounds this layer's inputs to int8 blocks of 64 and multiplies them by the codes
    # in integers (faster, not bit-exact; `compile_for_decoding(int8_activations=True)` sets it where the
    # layer's format allows); 0: float inputs, exact. Not used with gradients.
    activation_bits: int = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        config: QuantlabConfig,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.config = config
        # Built here, once: a layout built while torch.compile traces a call cannot be kept on the module.
        self._layout = _declared_layout(type(self), in_features, out_features, config)
        spec = self.storage_spec(in_features, out_features, config)
        for name, (shape, storage_dtype) in spec.items():
            self.register_buffer(name, torch.zeros(shape, dtype=storage_dtype, device=device))
        self.stored_names = tuple(spec)  # read on every call: a plain tuple traces without a guard
        self.input_rotation = input_rotation_block(in_features, config)  # 0: not rotated
        if self.input_rotation and self._layout is None:
            raise QuantizationError(
                f"{type(self).__name__} declares no storage layout, so it cannot rotate its input; "
                f"leave its layers out of rotate_inputs"
            )
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    # -- what a method defines --------------------------------------------------------------

    @property
    def format(self) -> str:
        """Storage format: the key (with the device) of this layer's kernels, its layout's codec."""
        return self.layout.codec

    @classmethod
    def layout_for(cls, in_features: int, out_features: int, config: QuantlabConfig) -> StorageLayout:
        """The storage layout of an `[out, in]` weight under `config`."""
        raise NotImplementedError

    @classmethod
    def quantize_weight(cls, weight: torch.Tensor, config: QuantlabConfig) -> dict[str, torch.Tensor]:
        """Float `[out, in]` weight → the stored tensors, by the codec's round-to-nearest."""
        return cls.layout_for(weight.shape[1], weight.shape[0], config).quantize(weight)

    # -- derived from the layout ----------------------------------------------------------

    @property
    def layout(self) -> StorageLayout:
        """This layer's layout (built on construction: the config and shape never change after it)."""
        layout = self.__dict__.get("_layout")
        if layout is None:
            layout = self._layout = self.layout_for(self.in_features, self.out_features, self.config)
        return layout

    @classmethod
    def storage_spec(cls, in_features: int, out_features: int, config: QuantlabConfig) -> StorageSpec:
        """Name → (shape, dtype) of every tensor the layer stores; `weight` holds the codes."""
        tensors = cls.layout_for(in_features, out_features, config).tensors
        return {name: (spec.shape, spec.dtype) for name, spec in tensors.items()}

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float `[out, in]` weight of the layer's input (`x @ W.T` is its output, less the bias)."""
        if not self.input_rotation:
            return self.dequantize_stored(dtype)
        return rotate(self.dequantize_stored(torch.float32), self.input_rotation).to(dtype)

    def stored_space(self, weight: torch.Tensor) -> torch.Tensor:
        """A float `[out, in]` weight of the layer's input as its codes store it: `W R` when it rotates its input."""
        if not self.input_rotation:
            return weight
        return rotate(weight.float(), self.input_rotation).to(weight.dtype)

    def dequantize_stored(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float `[out, in]` weight the stored tensors represent: the rotated weight `W R` when the
        layer rotates its input, the one kernels multiply the (rotated) input by."""
        return self.layout.dequantize(self.stored_tensors(), dtype)

    def codes_and_params(self) -> tuple[torch.Tensor, GroupParams]:
        """Unsigned codes `[out, groups, length]` and float32 grids, as the layout reads them."""
        return self.layout.load(self.stored_tensors())

    def bound_layout(self) -> StorageLayout:
        """The layout with the numbers this layer learned (a `lut` layer's level table): what its codes index."""
        return self.layout.bind(self.stored_tensors())

    # -- shared behaviour -----------------------------------------------------------------

    @classmethod
    def quantize_checked(
        cls, weight: torch.Tensor, config: QuantlabConfig, layer: str, stats: "InputStats | None" = None
    ) -> dict[str, torch.Tensor]:
        """The stored tensors of `weight` by the config's solver, after checking the weight and the result.

        Round-to-nearest is the method's own `quantize_weight` (its codec's, native and fast on CPU); other
        solvers work on the layout's grid; `stats` are the layer's calibration inputs.
        """
        if weight.dim() != 2:
            raise QuantizationError(f"{layer}: expected a 2-D Linear weight, got shape {tuple(weight.shape)}")
        from quantlab.kernels.quantize import count_nonfinite

        bad = count_nonfinite(weight)
        if bad:
            raise QuantizationError(
                f"{layer}: weight has {bad} NaN/Inf value(s) and cannot be quantized; repair the checkpoint, "
                f"or keep this layer in float with modules_to_not_convert=[{layer!r}]"
            )
        block = input_rotation_block(weight.shape[1], config)
        if block:  # the codes of `W R`, solved on the statistics of the rotated inputs
            weight = rotate(weight.detach().float(), block)
            stats = None if stats is None else stats.transformed(lambda hessian: rotate_square(hessian, block))
        solver = config.solver_object
        if solver.rounds_like_codec and stats is None:
            stored = cls.quantize_weight(weight.detach(), config)
        else:
            stored = cls._solve(weight.detach(), config, layer, stats, solver)
        expected = cls.storage_spec(weight.shape[1], weight.shape[0], config)
        if stored.keys() != expected.keys():
            raise TypeError(
                f"{cls.__name__}.quantize_weight returned {sorted(stored)}, storage_spec says {sorted(expected)}"
            )
        _check_finite(stored, layer, weight)
        return stored

    @classmethod
    def _solve(
        cls, weight: torch.Tensor, config: QuantlabConfig, layer: str, stats: "InputStats | None", solver: "Solver"
    ) -> dict[str, torch.Tensor]:
        layout = cls.layout_for(weight.shape[1], weight.shape[0], config)
        reason = solver.unsupported(layout)
        if reason:
            raise QuantizationError(f"{layer}: the {solver.name} solver cannot produce this layer's format: {reason}")
        if solver.needs_calibration and stats is None:
            raise QuantizationError(
                f"{layer}: the {solver.name} solver needs calibration data; quantize with "
                f"quantlab.quantize(model, config, calibration=...) or from_pretrained(path, quantization_config=...)"
            )
        layout = layout.prepare(weight, None if stats is None else stats.channel_weights())
        solution = solver.solve(weight, layout, stats, dict(config.solver_options or {}))
        return layout.store(solution.codes, solution.params)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, config: QuantlabConfig, layer: str = "", stats: "InputStats | None" = None
    ) -> "QuantizedLinear":
        """Quantize a float `nn.Linear` (with its calibration `stats` for calibrated solvers); the bias is kept."""
        return cls.from_stored(
            linear, config, cls.quantize_checked(linear.weight, config, layer or type(linear).__name__, stats)
        )

    @classmethod
    def from_stored(
        cls, linear: nn.Linear, config: QuantlabConfig, stored: dict[str, torch.Tensor]
    ) -> "QuantizedLinear":
        """The layer replacing `linear` with the stored tensors `quantize_checked` made; the bias is kept."""
        weight = linear.weight
        module = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            config,
            dtype=weight.dtype,
            device=weight.device,
        )
        module.load_stored(stored)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return module

    def load_stored(self, stored: dict[str, torch.Tensor]) -> None:
        for name, tensor in stored.items():
            setattr(self, name, tensor.to(getattr(self, name).device))

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.stored_names}

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored_tensors().values())

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """A float `nn.Linear` with the dequantized weight."""
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.float32)
        weight = self.dequantize_weight(dtype)
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=weight.device)
        linear.weight = nn.Parameter(weight)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().to(dtype))
        return linear.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_rotation:
            x = rotate(x, self.input_rotation)
        return select_kernel(self.format, x.device.type)(self, x)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        if self.input_rotation:
            shape += f", input_rotation={self.input_rotation}"
        return f"{shape}, bias={self.bias is not None}, config={self.config!r}"

    def stored_tensor_names(self) -> tuple[str, ...]:
        return self.stored_names


def _declared_layout(
    cls: type[QuantizedLinear], in_features: int, out_features: int, config: QuantlabConfig
) -> StorageLayout | None:
    """The class's layout of this shape, or None when it declares none (it then defines its own
    `storage_spec` and `dequantize_weight`)."""
    try:
        return cls.layout_for(in_features, out_features, config)
    except NotImplementedError:
        return None


def _check_finite(stored: dict[str, torch.Tensor], layer: str, weight: torch.Tensor) -> None:
    """A finite weight must never give a non-finite scale: say which dtype overflowed instead."""
    for name, tensor in stored.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            largest = weight.detach().abs().max().item()
            raise QuantizationError(
                f"{layer}: {name} overflows {str(tensor.dtype).removeprefix('torch.')} (largest weight {largest:.3g}); "
                f"use scale_dtype='float32', or keep this layer in float with modules_to_not_convert=[{layer!r}]"
            )
