"""The exporter's graph clean-up: onnxscript's optimizer less the `SlicesSplit` rule, the same graph."""

from collections import Counter

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnxscript import optimizer, rewriter

from quantlab.export.onnx import graph_optimizer


class RotateHalf(torch.nn.Module):
    """Two halves of one tensor (SlicesSplit's pattern), constants to fold, a repeated subexpression."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = x[..., :4], x[..., 4:8]
        rotated = torch.cat((-second, first), dim=-1)
        scale = torch.ones(8).cumsum(0) * 2  # folded into a constant
        return (rotated * scale) @ self.weight + (x @ self.weight) + (x @ self.weight)


def _exported() -> ir.Model:
    torch.manual_seed(0)
    program = torch.onnx.export(
        RotateHalf().eval(), (torch.randn(2, 3, 8),), dynamo=True, optimize=False, verbose=False
    )
    return program.model


def _ops(model: ir.Model) -> Counter:
    return Counter(node.op_type for node in model.graph)


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_the_skipped_rule_is_one_of_onnxscripts_defaults_and_the_only_one_left_out() -> None:
    defaults = [rule.name for rule in rewriter._DEFAULT_REWRITE_RULES]
    assert set(defaults) >= graph_optimizer.SKIPPED_RULES
    assert [rule.name for rule in graph_optimizer.rewrite_rules()] == [
        name for name in defaults if name not in graph_optimizer.SKIPPED_RULES
    ]


def test_same_graph_as_onnxscripts_optimizer_and_same_outputs() -> None:
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    raw = _exported()
    expected = _run(raw, x)
    ours, theirs = _exported(), _exported()
    graph_optimizer.optimize(ours)
    optimizer.optimize_ir(theirs)
    rewriter.onnx_fusions.fuse(theirs)

    assert theirs.graph.num_nodes() < raw.graph.num_nodes()  # the case exercises the optimizer
    assert _ops(theirs)["Slice"] == 2  # torch's Slices carry steps: SlicesSplit does not rewrite them
    assert ir.to_proto(ours) == ir.to_proto(theirs)
    np.testing.assert_allclose(_run(ours, x), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5])
def test_dynamic_shapes_survive(rows: int) -> None:
    torch.manual_seed(0)
    module = RotateHalf().eval()
    batch = torch.export.Dim("batch")
    program = torch.onnx.export(
        module, (torch.randn(2, 3, 8),), dynamic_shapes=({0: batch},), dynamo=True, optimize=False, verbose=False
    )
    graph_optimizer.optimize(program.model)
    x = torch.randn(rows, 3, 8)
    with torch.inference_mode():
        expected = module(x).numpy()
    np.testing.assert_allclose(_run(program.model, x.numpy()), expected, rtol=1e-5, atol=1e-5)
