"""The `hqq` method: custom-bits storage with half-quadratically optimised zero points (and scales).

Only how the grid is chosen differs from `custom_bits` asymmetric: the stored tensors, the
packing and the dequantization `(q - zero) * scale` are the same, so `HqqLinear` keeps the
storage layout of custom bits (the affine codec), and the kernels, ONNX lowering and sparse
storage that read it apply with nothing registered.
"""

import dataclasses

import torch

from quantlab.errors import ConfigError
from quantlab.formats import grouping
from quantlab.formats.codec import GroupParams
from quantlab.formats.layout import StorageLayout
from quantlab.methods.custom_bits import CustomBitsConfig, CustomBitsLinear
from quantlab_hqq.optimize import AffineParams, optimize_affine_params

# Rows are optimised a slice at a time: the optimiser's temporaries (a few float32 copies of the
# slice, 1 MiB each) stay in cache and memory stays flat whatever the layer size. Groups are
# independent, so the result does not depend on the slice size.
MAX_WEIGHTS_PER_CHUNK = 1 << 18


@dataclasses.dataclass(repr=False)
class HqqConfig(CustomBitsConfig):
    """Calibration-free HQQ grid optimisation (Badri & Shaji 2023), bit-packed like custom_bits.

    `bits` 2..8 and `group_size` (power of two 32..256, or None per channel) as in custom bits,
    always with zero points. `iterations` half-quadratic steps minimising `sum |w - w_q|^lp_norm`
    per group; `beta` (in grid steps) and `kappa` set the splitting schedule; `optimize_scale`
    refits the scale with the zero point at each step.
    """

    method = "hqq"

    # The grid is asymmetric by construction: the zero point is what HQQ optimises.
    symmetric: bool = dataclasses.field(default=False, init=False)
    iterations: int = dataclasses.field(
        default=20, metadata={"help": "half-quadratic steps; 0 keeps the start (min-max scale, integer zero point)"}
    )
    lp_norm: float = dataclasses.field(default=0.7, metadata={"help": "p of the error norm minimised, in (0, 1]"})
    beta: float = dataclasses.field(
        default=1.0, metadata={"help": "coupling in grid steps: residuals above beta^(-1/(2-p)) count as outliers"}
    )
    kappa: float = dataclasses.field(default=1.01, metadata={"help": "growth of beta per step, >= 1"})
    optimize_scale: bool = dataclasses.field(
        default=False, metadata={"help": "refit the scale with the zero point at each step"}
    )

    def validate(self) -> None:
        super().validate()
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int) or self.iterations < 0:
            raise ConfigError(f"hqq: iterations={self.iterations!r} is not valid; use a whole number >= 0 (0 = RTN)")
        if not _is_number(self.lp_norm) or not 0 < self.lp_norm <= 1:
            raise ConfigError(f"hqq: lp_norm={self.lp_norm!r} is not valid; use a number in (0, 1] (HQQ uses 0.7)")
        if not _is_number(self.beta) or self.beta <= 0:
            raise ConfigError(f"hqq: beta={self.beta!r} is not valid; use a positive number")
        if not _is_number(self.kappa) or self.kappa < 1:
            raise ConfigError(f"hqq: kappa={self.kappa!r} is not valid; use a number >= 1 (HQQ uses 1.01)")
        if not isinstance(self.optimize_scale, bool):
            raise ConfigError(f"hqq: optimize_scale={self.optimize_scale!r} is not valid; use true or false")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class HqqLinear(CustomBitsLinear):
    """A custom-bits Linear whose scales and zero points come from the HQQ optimiser."""

    config_class = HqqConfig

    @classmethod
    def quantize_weight(cls, weight: torch.Tensor, config: HqqConfig) -> dict[str, torch.Tensor]:
        layout = cls.layout_for(weight.shape[1], weight.shape[0], config)
        grouped = grouping.group(weight.float(), config.group_size)
        rows_per_chunk = max(1, MAX_WEIGHTS_PER_CHUNK // max(1, grouped[0].numel()))
        codes, scales, zeros = [], [], []
        with torch.no_grad():
            for rows in grouped.split(rows_per_chunk):
                params = optimize_affine_params(
                    rows,
                    config.bits,
                    iterations=config.iterations,
                    lp_norm=config.lp_norm,
                    beta=config.beta,
                    kappa=config.kappa,
                    optimize_scale=config.optimize_scale,
                )
                # Codes are chosen with the scale and zero point as stored, not their float32 originals.
                stored = _storable(layout, params, rows)
                codes.append(layout.quantize_grouped(rows, stored))
                scales.append(stored.scale)
                zeros.append(stored.zero)
        return layout.store(torch.cat(codes), GroupParams(scale=torch.cat(scales), zero=torch.cat(zeros)))


def _storable(layout: StorageLayout, params: AffineParams, rows: torch.Tensor) -> GroupParams:
    """The optimiser's grid as stored (float32 values), by the affine codec's rule (`AffineCodec.grid`):
    a scale that is zero in the scale dtype becomes 1 with zero point `-min`, which represents a
    (near-)constant group exactly. A scale or zero point the optimiser leaves non-finite in the scale
    dtype (an underflow or overflow there) counts as a zero scale."""
    dtype = layout.scale_dtype
    broken = ~torch.isfinite(params.scale.to(dtype)) | ~torch.isfinite(params.zero.to(dtype))
    scale = torch.where(broken, torch.zeros_like(params.scale), params.scale)
    return layout.codec_object.grid(layout, scale, params.zero, low=rows.amin(dim=-1))
