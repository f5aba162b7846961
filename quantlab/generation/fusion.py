"""Fused projections in the compiled decode step: q/k/v, and gate/up, as one quantized matmul each.

In a decode step every quantized layer is one `quantlab::linear` call, and at one row each call is
mostly fixed cost: waking the thread team, preparing x, joining. The projections that read the same
input (a Llama block's q/k/v read one normed hidden state, gate/up another) can share it: this inductor
pass replaces the `quantlab::linear` nodes of the compiled graph that read the same tensor with the
same layout by one `quantlab::linear_group` call (x prepared once, one parallel region over the output
features of all of them) and slices its output back for their users; every value is the one
`quantlab::linear` gives (see ql_gemm_group). A Llama block goes from 7 calls to 4.

Only the compiled graph changes: the modules, what is saved, ONNX export and PEFT adapters see the
original layers, and the eager path stays unfused. The pass runs after autograd on inference graphs
only (a graph that trains keeps its calls: `linear_group` has no gradient). It is a
`CustomGraphPass` with a `uuid()` (this file's hash), so inductor's FX graph cache keys on it, and a
`str`, as `SKIP_MODULE_GUARDS` is: transformers hashes and saves the compile options through JSON.
"""

from collections import defaultdict

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass, get_hash_for_files

from quantlab.kernels.cpu import ops

# quantlab::linear(x, bias, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, <6 layout integers>)
_PER_LAYER = slice(1, 8)
_LAYOUT = slice(8, 14)
_ARGUMENTS = 14


class FuseProjections(str, CustomInferenceAwareGraphPass):
    """Replace the `quantlab::linear` nodes reading one tensor with one layout by one
    `quantlab::linear_group` node; counts what it fused in dynamo's `counters["quantlab"]`."""

    def __call__(self, graph: torch.fx.Graph, is_inference: bool) -> None:
        if not is_inference or ops.linear_op is None:  # no operators loaded: the graph has no such nodes
            return
        for members in _groups(graph):
            _fuse(graph, members)
            counters["quantlab"]["projection_groups"] += 1
            counters["quantlab"]["fused_projections"] += len(members)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


FUSE_PROJECTIONS = FuseProjections("quantlab: fuse projections")


def _groups(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """Nodes to fuse, in graph order: same input, same layout integers, the same optional arguments
    given, and every argument defined before the first of them (where the grouped call goes)."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    candidates = defaultdict(list)
    for node in graph.nodes:
        if node.target is ops.linear_op and len(node.args) == _ARGUMENTS and not node.kwargs:
            given = tuple(argument is None for argument in node.args[_PER_LAYER])
            candidates[(node.args[0], *node.args[_LAYOUT], given)].append(node)
    groups = []
    for nodes in candidates.values():
        first = order[nodes[0]]
        members = [nodes[0], *(node for node in nodes[1:] if all(order[a] < first for a in node.all_input_nodes))]
        if len(members) > 1:
            groups.append(members)
    return groups


def _fuse(graph: torch.fx.Graph, members: list[torch.fx.Node]) -> None:
    first = members[0]
    x = first.args[0]
    per_layer = [list(column) for column in zip(*(node.args[_PER_LAYER] for node in members), strict=True)]
    values = [node.meta["val"] for node in members]
    last = values[0].dim() - 1
    with graph.inserting_before(first):
        group = graph.call_function(ops.linear_group_op, (x, *per_layer, *first.args[_LAYOUT]))
        group.meta["val"] = torch.cat(values, dim=last)  # fake tensors: the shape, dtype and strides it has
        start = 0
        for node, value in zip(members, values, strict=True):
            end = start + value.shape[last]
            part = graph.call_function(torch.ops.aten.slice.Tensor, (group, last, start, end))
            part.meta["val"] = torch.ops.aten.slice.Tensor(group.meta["val"], last, start, end)
            node.replace_all_uses_with(part)
            start = end
    for node in members:  # after the inserts: they go before the first member
        graph.erase_node(node)
