"""`QATOptions`: what a quantization-aware training run trains in each quantized layer, checked once."""

import dataclasses
from dataclasses import field
from typing import Literal

from quantlab.errors import ConfigError

TRAINED = ("weights", "grids", "auto")


@dataclasses.dataclass(frozen=True)
class QATOptions:
    """What a run trains in each quantized layer.

    `train`: "weights" trains every weight through a fake quantizer (`quantlab.nn.fake_quant`: the
    codes move; five floats of state a weight); "grids" keeps the codes and trains only each group's
    scale and zero point and a `lut` layer's table (`quantlab.nn.grid_trained`: EfficientQAT's E2E-QP;
    one byte a weight), so memory does not grow with the weights trained; "auto" (the default) takes
    "weights" where its predicted peak fits the memory available and "grids" where it would not
    (`quantlab.qat.memory`).
    `max_offset`: bound of each weight's move from its start, in grid steps; None (the default)
    leaves it unbounded, so the latent float weight itself trains through the straight-through
    estimator (LSQ and EfficientQAT train the weights; 0.5 is AutoRound's bounded rounding).
    `learn_scales`: also train each group's scale (LSQ-style, as a ratio to its start, so the
    clipping is learned) and zero point where the format stores one. `scale_lr_ratio`: the
    scales' learning rate as a multiple of the run's (offsets are in grid steps, scales in ratios).
    `norm_lr_ratio`: also train the float weights (and biases) of the normalization layers (RMSNorm,
    LayerNorm) at this multiple of the run's rate, without weight decay; None (the default) keeps
    them frozen. They stay float in the saved checkpoint, so its bits per weight do not change.
    `embedding_lr_ratio`: also train the float token embedding tables (`nn.Embedding`) and a float output
    head (tied to the input table or not) at this multiple of the run's rate, without weight decay; None
    (the default) keeps them frozen. Like the norms they stay float, so the bits per weight do not change;
    they cost 12 bytes a table entry (gradient and two Adam moments).
    """

    train: Literal["auto", "weights", "grids"] = field(
        default="auto",
        metadata={
            "help": "weights: every weight through a fake quantizer (the codes move; about 25 bytes a weight); "
            "grids: the codes frozen, only scales, zero points and tables trained (1 byte a weight); auto: "
            "weights where that fits in the memory available, else grids"
        },
    )
    max_offset: float | None = field(
        default=None, metadata={"help": "bound of each weight's move in grid steps (none: the latent weights train)"}
    )
    learn_scales: bool = field(default=True, metadata={"help": "also train each group's scale and zero point"})
    scale_lr_ratio: float = field(
        default=0.2, metadata={"help": "the scales' learning rate as a multiple of --learning-rate"}
    )
    norm_lr_ratio: float | None = field(
        default=None,
        metadata={"help": "also train the normalization layers' float weights at this multiple of --learning-rate"},
    )
    embedding_lr_ratio: float | None = field(
        default=None,
        metadata={
            "help": "also train the float token embedding tables and output head at this multiple of --learning-rate"
        },
    )

    def __post_init__(self) -> None:
        if self.train not in TRAINED:
            raise ConfigError(f"train={self.train!r} is not valid; use one of {', '.join(TRAINED)}")
        if self.train == "grids" and self.max_offset is not None:
            raise ConfigError("max_offset bounds the weights' moves, and train='grids' keeps the codes; drop one")
        if self.train == "grids" and not self.learn_scales:
            raise ConfigError("train='grids' trains scales, zero points and tables only; drop learn_scales=False")
        if self.max_offset is not None and not self.max_offset > 0:
            raise ConfigError(f"max_offset={self.max_offset!r} must be > 0 grid steps, or None for unbounded")
        if not self.scale_lr_ratio > 0:
            raise ConfigError(f"scale_lr_ratio={self.scale_lr_ratio!r} must be > 0")
        if self.norm_lr_ratio is not None and not self.norm_lr_ratio > 0:
            raise ConfigError(f"norm_lr_ratio={self.norm_lr_ratio!r} must be > 0, or None to keep the norms frozen")
        if self.embedding_lr_ratio is not None and not self.embedding_lr_ratio > 0:
            raise ConfigError(
                f"embedding_lr_ratio={self.embedding_lr_ratio!r} must be > 0, or None to keep the embeddings frozen"
            )

    @property
    def trains_weights(self) -> bool:
        """Whether the codes move (a resolved "weights" run; "auto" must be resolved first)."""
        if self.train == "auto":
            raise ValueError("resolve train='auto' first (quantlab.qat.memory.resolve_training)")
        return self.train == "weights"

    def settings(self) -> dict[str, object]:
        """What a resumed run must share with the saved one (joins the checkpoint's fingerprint)."""
        return dataclasses.asdict(self)
