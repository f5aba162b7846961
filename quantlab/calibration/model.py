"""Calibrated quantization of a whole model: its windows of text, mixed-precision bits, then block by block.

What `quantlab.quantize` and the transformers quantizer run for a config that needs calibration
(`solver="gptq"`, `awq=True`, `target_bits`, `self_calibration`); the layers outside the
calibrated blocks are then quantized data-free with the plan's `data_free` config.
"""

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from quantlab import distributed
from quantlab.calibration.allocation import allocate_bits, check_budget_reachable
from quantlab.calibration.blocks import BlockWeights
from quantlab.calibration.data import calibration_windows, windows_from_texts
from quantlab.calibration.self_generated import self_generated_windows
from quantlab.calibration.sequential import quantize_blocks
from quantlab.config import QuantlabConfig
from quantlab.errors import QuantizationError
from quantlab.utils.model_kind import is_language_model

if TYPE_CHECKING:
    from quantlab.plan import QuantizationPlan


def calibrate(
    model: nn.Module,
    plan: "QuantizationPlan",
    calibration: torch.Tensor | list[str] | None,
    tokenizer: Any,
    progress: bool = True,
    weights: BlockWeights | None = None,
) -> list[str]:
    """Quantize the plan's layers inside the model's blocks with the calibrated solver; returns their names.

    Mixed precision (`target_bits`) first chooses each layer's width and group on the windows and
    stores them in the plan's config. `weights`: where the blocks' weights are (default: in the
    model; streamed: read block by block). Under torchrun the processes share the windows
    (`quantlab.distributed`)."""
    distributed.init()
    config = plan.config
    if plan.allocates:
        check_budget_reachable(model, plan)
    windows = windows_for(model, config, calibration, tokenizer, progress, weights)
    if plan.allocates:
        plan.set_layer_options(allocate_bits(model, plan, windows, progress, weights))
    if not plan.calibrates_blocks:
        return []  # mixed precision with a data-free solver: the layers are quantized as usual next
    return quantize_blocks(model, plan, windows, progress, weights)


def windows_for(
    model: nn.Module,
    config: QuantlabConfig,
    calibration: torch.Tensor | list[str] | None,
    tokenizer: Any,
    progress: bool = True,
    weights: BlockWeights | None = None,
) -> torch.Tensor:
    """The calibration windows `[samples, seq_len]`: given token ids, texts, the config's text, or sampled
    from the float model itself (`self_calibration`)."""
    if config.self_calibration:
        if calibration is not None:
            raise QuantizationError(
                "self_calibration samples its own text; pass calibration=None or drop self_calibration"
            )
        with (weights or BlockWeights()).whole_model():
            return self_generated_windows(
                model, config.calibration_samples, config.calibration_seq_len, progress=progress
            )
    if isinstance(calibration, torch.Tensor):
        return calibration.long()
    if tokenizer is None:
        raise QuantizationError(
            f"the {config.solver} solver{' with awq' if config.awq else ''} calibrates on text: pass token ids "
            f"(calibration=tensor) or a tokenizer (tokenizer=...)"
        )
    if calibration is not None:
        return windows_from_texts(tokenizer, calibration, config.calibration_samples, config.calibration_seq_len)
    return calibration_windows(
        tokenizer, config.calibration_samples, config.calibration_seq_len, config.calibration_text,
        encoder=not is_language_model(model),
    )  # fmt: skip
