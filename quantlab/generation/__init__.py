"""Generation on quantized (and float) causal LMs: the compiled static-cache decode path, and for
Llama-family models the native decode step behind it (native.py)."""

from quantlab.generation.compiled import (
    CPU_COMPILE_MODES,
    compile_for_decoding,
    disable_compiled_decoding,
    fast_decoding_config,
    warm_up,
)
from quantlab.generation.counters import CompileCounts, count_compilations

__all__ = [
    "CPU_COMPILE_MODES",
    "CompileCounts",
    "compile_for_decoding",
    "count_compilations",
    "disable_compiled_decoding",
    "fast_decoding_config",
    "warm_up",
]
