"""The fast decode path as the tests set it up: one compiled step, checked to be one graph."""

from typing import Any

import torch

from quantlab.generation import compile_for_decoding, warm_up


def compiled_for_decoding(model: Any, **options: Any) -> Any:
    """`model` set up by `compile_for_decoding(max_cache_len=64, **options)` after a dynamo reset, and
    warmed up; asserts full-graph mode and one frame, one graph, no break. Returns `model`."""
    torch._dynamo.reset()
    compile_for_decoding(model, max_cache_len=64, **options)
    assert model.generation_config.compile_config.fullgraph  # a graph break would be an error
    counts = warm_up(model)
    assert (counts.frames, counts.graphs, counts.graph_breaks) == (1, 1, 0), counts.break_reasons
    return model
