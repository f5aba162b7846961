"""Calibrated quantization: windows of text, block-by-block solving, activation-aware scaling."""

from quantlab.calibration.data import EVAL_TOKENS, CalibrationDataError, calibration_windows
from quantlab.calibration.sequential import collect_input_stats, quantize_blocks

__all__ = ["EVAL_TOKENS", "CalibrationDataError", "calibration_windows", "collect_input_stats", "quantize_blocks"]
