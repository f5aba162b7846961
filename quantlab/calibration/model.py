"""Calibrated quantization of a whole model: its windows of text, mixed-precision bits, then block by block.

What `quantlab.quantize` and the transformers quantizer run for a config that needs calibration
(`solver="gptq"`, `awq=True`, `target_bits`, `self_calibration`); the layers outside the
calibrated blocks are then quantized data-free with `data_free_config`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

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
from quantlab.nn import QuantizedLinear
from quantlab.solvers import get_solver
from quantlab.utils.model_kind import is_language_model


def calibrate(
    model: nn.Module,
    config: QuantlabConfig,
    module_class: type[QuantizedLinear],
    selected: Callable[[str], bool],
    calibration: torch.Tensor | list[str] | None,
    tokenizer: Any,
    progress: bool = True,
    weights: BlockWeights | None = None,
) -> list[str]:
    """Quantize the selected Linear layers inside the model's blocks with the calibrated solver.

    `weights`: where the blocks' weights are (default: in the model; streamed: read block by block).
    Under torchrun the processes share the windows (`quantlab.distributed`)."""
    distributed.init()
    if config.target_bits is not None:
        check_budget_reachable(model, config, module_class, selected)
    windows = windows_for(model, config, calibration, tokenizer, progress, weights)
    if config.target_bits is not None:
        config.layer_options = allocate_bits(model, config, module_class, windows, selected, progress, weights)
    if not blocks_need_calibration(config):
        return []  # mixed precision with a data-free solver: the layers are quantized as usual next
    return quantize_blocks(model, config, module_class, windows, selected, progress, weights)


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


def blocks_need_calibration(config: QuantlabConfig) -> bool:
    """Whether the blocks are quantized by the calibrated schedule (a calibrated solver, or AWQ's scaling)."""
    return config.awq or get_solver(config.solver).needs_calibration


def data_free_config(config: QuantlabConfig) -> QuantlabConfig:
    """The config for layers quantized without statistics: all of them under a data-free solver, and
    under a calibrated one those outside the calibrated blocks (an untied output head, a pooler),
    which get the data-free mse solver on the same storage format."""
    if not config.needs_calibration:
        return config
    solver = "mse" if get_solver(config.solver).needs_calibration else config.solver
    options = config.solver_options if solver == config.solver else None
    return dataclasses.replace(
        config, solver=solver, solver_options=options, awq=False, target_bits=None, self_calibration=False
    )
