"""Generation on quantized (and float) causal LMs: the compiled static-cache decode path, and for
Llama-family models the native decode step behind it (native.py); a quantized KV cache (kv_cache.py).

The compiled path's names load on first use: importing it pulls in transformers' attention
registry, which `import quantlab` (that exports `QuantizedKVCache`) should not pay for.
"""

import importlib
from typing import Any

from quantlab.generation.kv_cache import QuantizedKVCache

_LAZY = {
    "CPU_COMPILE_MODES": "quantlab.generation.compiled",
    "compile_for_decoding": "quantlab.generation.compiled",
    "disable_compiled_decoding": "quantlab.generation.compiled",
    "fast_decoding_config": "quantlab.generation.compiled",
    "warm_up": "quantlab.generation.compiled",
    "CompileCounts": "quantlab.generation.counters",
    "count_compilations": "quantlab.generation.counters",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CPU_COMPILE_MODES",
    "CompileCounts",
    "QuantizedKVCache",
    "compile_for_decoding",
    "count_compilations",
    "disable_compiled_decoding",
    "fast_decoding_config",
    "warm_up",
]
