"""Fused projections in the compiled decode step: q/k/v, and gate/up, as one quantized matmul each.

In a decode step every quantized layer is one `quantlab::linear` call, and at one row each call is
mostly fixed cost: waking the thread team, preparing x, joining. The projections that read the same
input (a Llama block's q/k/v read one normed hidden state, gate/up another) can share it: this inductor
pass replaces the `quantlab::linear` nodes of the compiled graph that read the same tensor with the
same layout by one `quantlab::linear_group` call (x prepared once, one parallel region over the output
features of all of them) and slices its output back for their users; every value is the one
`quantlab::linear` gives (see ql_gemm_group). A Llama block goes from 7 calls to 4.

With `activation_bits=8` (`compile_for_decoding(int8_activations=True)`) every 4-bit affine or int8
layer of the step (groups of 64 or a multiple, an int8 output head included) runs on x rounded to int8
per block of 64 inputs, with integer dot products (AVX2 or AVX512-VNNI), as llama.cpp's Q4_0 x Q8_0 and
Q8_0 x Q8_0 do: faster at one row, at a small relative error in each output (both measured in
benchmarks/RESULTS.md); off by default.

Only the compiled graph changes: the modules, what is saved, ONNX export and PEFT adapters see the
original layers, and the eager path stays unfused. The pass runs after autograd on inference graphs
only (a graph that trains keeps its calls: `linear_group` has no gradient). It is a
`CustomGraphPass` with a `uuid()` (this file's hash and its options), so inductor's FX graph cache keys on it, and a
`str`, as `SKIP_MODULE_GUARDS` is: transformers hashes and saves the compile options through JSON.
"""

from collections import defaultdict

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass, get_hash_for_files

from quantlab.formats.layout import parse_descriptor
from quantlab.kernels.cpu import ops
from quantlab.kernels.cpu.weights import describable
from quantlab.nn import QuantizedLinear

# quantlab::linear(x, bias, descriptor, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset): a
# node holds the arguments it was given, the trailing absent tensors left out.
_ARGUMENTS = 9


def _arguments(node: torch.fx.Node) -> tuple:
    """A `quantlab::linear` node's arguments, all nine (absent tensors as None)."""
    return (*node.args, *[None] * (_ARGUMENTS - len(node.args)))


def _per_layer(node: torch.fx.Node) -> tuple:
    """What differs between the layers of a `linear_group`: the bias, then the six weight tensors."""
    arguments = _arguments(node)
    return (arguments[1], *arguments[3:])


class FuseProjections(str, CustomInferenceAwareGraphPass):
    """Replace the `quantlab::linear` nodes reading one tensor with one layout by one
    `quantlab::linear_group` node (`fuse`), and with `activation_bits=8` run every layer whose format
    allows it on int8 activations (`linear_group` of one or more layers; see `int8_ready`); counts what
    it did in dynamo's `counters["quantlab"]`."""

    def __new__(cls, fuse: bool = True, activation_bits: int = 0) -> "FuseProjections":
        if activation_bits not in (0, 8):
            raise ValueError(f"activation_bits is 0 (float activations) or 8, not {activation_bits}")
        name = "quantlab: fuse projections" + (" with int8 activations" if activation_bits else "")
        self = super().__new__(cls, name if fuse else f"{name}, unfused")
        self.fuse, self.activation_bits = fuse, activation_bits
        return self

    def __getnewargs__(self) -> tuple[bool, int]:  # copies (compile options are deep-copied) rebuild it
        return self.fuse, self.activation_bits

    def __call__(self, graph: torch.fx.Graph, is_inference: bool) -> None:
        if not is_inference or ops.linear_op is None:  # no operators loaded: the graph has no such nodes
            return
        for members in _groups(graph, self.fuse, self.activation_bits):
            bits = self.activation_bits if int8_ready(members[0]) else 0
            _fuse(graph, members, bits)
            if len(members) > 1:
                counters["quantlab"]["projection_groups"] += 1
                counters["quantlab"]["fused_projections"] += len(members)
            if bits:
                counters["quantlab"]["int8_activation_layers"] += len(members)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,)) + str(self).encode()


FUSE_PROJECTIONS = FuseProjections()


def int8_ready(node: torch.fx.Node) -> bool:
    """Whether the int8-activation kernel takes this layer (`ql_a8_eligible`), as its codec says: 4-bit affine
    or int8 codes in groups of 64 or a multiple, a per-channel group being the row (on a CPU without AVX2 the
    kernel computes it in float instead)."""
    descriptor = parse_descriptor(node.args[2])
    return descriptor.codec_object.int8_activations(descriptor)


def mark_int8_activations(model: torch.nn.Module, bits: int) -> int:
    """Set `activation_bits` of every quantized layer of `model` the int8-activation kernel takes (8), or of
    every one back to float inputs (0), so the model's eager forwards (a prompt's prefill, a teacher-forced
    evaluation) compute as the compiled steps with `activation_bits` do; returns how many layers were set."""
    marked = 0
    for module in model.modules():
        if not isinstance(module, QuantizedLinear):
            continue
        ready = bits and describable(module.layout) and _module_int8_ready(module)
        module.activation_bits = bits if ready else 0
        marked += bool(ready)
    return marked


def _module_int8_ready(module: torch.nn.Module) -> bool:
    descriptor = parse_descriptor(ops.weight_arguments(module)[0])
    return descriptor.codec_object.int8_activations(descriptor)


def _groups(graph: torch.fx.Graph, fuse: bool, activation_bits: int) -> list[list[torch.fx.Node]]:
    """Nodes to replace, in graph order: with `fuse`, those of the same input, same layout descriptor, the
    same optional arguments given, and every argument defined before the first of them (where the
    grouped call goes); with int8 activations, every other layer `int8_ready` takes, alone."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    candidates = defaultdict(list)
    for node in graph.nodes:
        if node.target is ops.linear_op and not node.kwargs:
            given = tuple(argument is None for argument in _per_layer(node))
            candidates[(node.args[0], node.args[2], given)].append(node)
    groups = []
    for nodes in candidates.values():
        first = order[nodes[0]]
        members = [nodes[0], *(node for node in nodes[1:] if all(order[a] < first for a in node.all_input_nodes))]
        if not fuse or len(members) == 1:
            members = []
        else:
            groups.append(members)
        if activation_bits:
            groups.extend([node] for node in nodes if node not in members and int8_ready(node))
    return groups


def _fuse(graph: torch.fx.Graph, members: list[torch.fx.Node], activation_bits: int) -> None:
    first = members[0]
    x, descriptor = first.args[0], first.args[2]
    per_layer = [list(column) for column in zip(*(_per_layer(node) for node in members), strict=True)]
    values = [node.meta["val"] for node in members]
    last = values[0].dim() - 1
    with graph.inserting_before(first):
        group = graph.call_function(ops.linear_group_op, (x, per_layer[0], descriptor, *per_layer[1:], activation_bits))
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
