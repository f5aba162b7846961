"""The quantization plan: what a config does to a model, decided once, run by every executor."""

from quantlab.nn.kinds import is_quantizable_linear, register_linear_kind
from quantlab.plan.build import build_plan, skip_list
from quantlab.plan.execute import empty_layers, quantize_loaded
from quantlab.plan.plan import FloatWeight, PlannedLayer, QuantizationPlan, calibrates_blocks, data_free_config

__all__ = [
    "FloatWeight",
    "PlannedLayer",
    "QuantizationPlan",
    "build_plan",
    "calibrates_blocks",
    "data_free_config",
    "empty_layers",
    "is_quantizable_linear",
    "quantize_loaded",
    "register_linear_kind",
    "skip_list",
]
