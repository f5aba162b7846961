"""How much torch.compile compiled: frames, graphs and graph breaks, counted by dynamo.

A decode step that recompiles (a guard failed: a new shape, dtype or Python constant) or breaks
its graph (something dynamo cannot trace) runs far slower than the compiled graph, and dynamo
says so only in debug logs (`TORCH_LOGS=recompiles,graph_breaks`). `count_compilations()` measures
it around any code, so a benchmark or a test can check that decoding compiles once, during the
warm-up, and never again.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler
from torch._dynamo.utils import counters


@dataclass
class CompileCounts:
    """What dynamo did: `frames` compiled (each recompilation is one more), `graphs` produced (a graph
    break splits a frame into several), `graph_breaks` with their reasons."""

    frames: int = 0
    graphs: int = 0
    graph_breaks: int = 0
    break_reasons: dict[str, int] = field(default_factory=dict)


def _graph_totals() -> tuple[int, dict[str, int]]:
    return counters["stats"]["unique_graphs"], dict(counters["graph_break"])


@contextmanager
def count_compilations() -> Iterator[CompileCounts]:
    """`with count_compilations() as counts: ...`; afterwards `counts` holds what the block compiled."""
    counts = CompileCounts()

    def on_compile(args: CallbackArgs) -> None:
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            counts.frames += 1

    graphs, reasons = _graph_totals()
    callback_handler.register_start_callback(on_compile)
    try:
        yield counts
    finally:
        callback_handler.remove_start_callback(on_compile)
        graphs_now, reasons_now = _graph_totals()
        counts.graphs = graphs_now - graphs
        counts.break_reasons = {
            reason: count - reasons.get(reason, 0)
            for reason, count in reasons_now.items()
            if count != reasons.get(reason, 0)
        }
        counts.graph_breaks = sum(counts.break_reasons.values())
