"""The graph clean-up `torch.onnx.export(optimize=True)` runs, less the one rewrite rule that costs minutes.

`torch.onnx.export` hands its graph to onnxscript's optimizer: constant folding, onnxscript's default
rewrite rules, removal of unused nodes, initializer lifting and deduplication, common subexpressions, then
onnxscript's ONNX fusions. One default rule, `SlicesSplit` (two Slices of one tensor become a Split), has
a pattern with several output nodes, which onnxscript's matcher tries against the whole graph again for
every Slice: on a 30-layer decoder (rotary embeddings slice every query and key in two) the export of
SmolLM2-135M 4-bit takes 1.7-1.8x as long with it (benchmarks/onnx_export_time.py). It never rewrites
what torch exports (torch's Slices carry a `steps` input, the rule's pattern has none), so the exporter
runs the same passes without it and writes the same file.
"""

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxscript.rewriter.onnx_fusions
from onnxscript import rewriter
from onnxscript.optimizer import _constant_folding

SKIPPED_RULES = frozenset({"SlicesSplit"})
ITERATIONS = 2  # onnxscript's default: fold and rewrite twice, or until nothing changes


def rewrite_rules() -> list:
    """onnxscript's default rewrite rules less `SKIPPED_RULES`."""
    return [rule for rule in rewriter._DEFAULT_REWRITE_RULES if rule.name not in SKIPPED_RULES]


def optimize(model: ir.Model) -> None:
    """In place: the passes of onnxscript's `optimize_ir` and `onnx_fusions.fuse`, with `rewrite_rules()`."""
    repeated = ir.passes.PassManager(
        [
            _constant_folding.FoldConstantsPass(
                shape_inference=True,
                input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                should_fold=lambda node: None,
            ),
            rewriter.RewritePass(rewrite_rules()),
            common_passes.RemoveUnusedNodesPass(),
            common_passes.RemoveUnusedFunctionsPass(),
            common_passes.RemoveUnusedOpsetsPass(),
        ],
        steps=ITERATIONS,
        early_stop=True,
    )
    passes = ir.passes.Sequential(
        common_passes.InlinePass(),
        repeated,
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )
    passes(model)
    onnxscript.rewriter.onnx_fusions.fuse(model)
