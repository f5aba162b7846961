"""The peak resident memory a streamed quantization should need, from the model's shape and the config.

    peak = memory before loading + max(blocks phase, end phase)
    blocks phase = one float block + its stored (quantized) tensors
                   [fused experts: + twice the float gate/up projection, while its per-expert tensors are merged]
                   [calibrated: + the input embedding
                                + the calibration activations, the block's inputs and outputs:
                                  2 x samples x seq_len x hidden (with --offload-dir, one batch of 8)
                                + the largest of
                                  summing: the statistics as float64 sums, 8 in^2 per Linear layer
                                           + one batch's forward temporaries: 8 x seq_len x (3 x intermediate
                                             + 2 x heads x seq_len) + a panel of X^T X: 4 in x min(in, 2048)
                                  solving: the statistics as float32 means, 4 in^2 per Linear layer
                                           + GPTQ's working set for the widest layer: one float64 `in x in`
                                             (its factor rounded to float32 inside it), float32 copies of its
                                             weight (two while its columns are reordered), 8 in x out]
    end phase = every tensor outside the blocks in float + the quantized ones among them

Per Linear layer is an upper bound: layers reading one input share one statistics, and each is released
once its last layer is solved. The float32 mean of the widest input is made while its float64 sum still
exists (12 in^2 for that moment), which the solving term covers. All in the dtype the model loads in
(float32 for the statistics). It leaves out the allocator's slack, Python objects and the tokenizer;
`benchmarks/RESULTS.md` compares it with measured peaks.
"""

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from quantlab.calibration.sequential import BATCH_SIZE
from quantlab.config import QuantlabConfig
from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_embedding import QuantizedTable
from quantlab.nn.quantized_experts import QuantizedExperts
from quantlab.plan.plan import calibrates_blocks
from quantlab.solvers import InputStats


@dataclass
class MemoryPrediction:
    total: int
    terms: dict[str, int] = field(default_factory=dict)


def predict_peak(
    shell: nn.Module, blocks_name: str, config: QuantlabConfig, before: int, offloaded: bool = False
) -> MemoryPrediction:
    """The predicted peak of quantizing into `shell` (the output model on the meta device, its blocks
    under `blocks_name`) with `config`, for a process that held `before` bytes before loading
    (`offloaded`: the activations wait on disk, one batch of them in memory)."""
    blocks = shell.get_submodule(blocks_name)
    itemsize = shell.dtype.itemsize
    float_block = max(_float_bytes(block, itemsize) for block in blocks)
    stored_block = max(_stored_bytes(block) for block in blocks)
    inside = {id(m) for m in blocks.modules()}
    outside = [m for m in shell.modules() if id(m) not in inside]
    outside_float = sum(_own_float_bytes(m, itemsize) for m in outside)
    outside_stored = sum(_own_stored_bytes(m) for m in outside if isinstance(m, QuantizedLinear | QuantizedTable))
    terms = {"before loading": before, "one float block": float_block, "its stored tensors": stored_block}
    blocks_phase = float_block + stored_block
    fused = max((_float_bytes(m, itemsize) * 2 // 3 for m in blocks.modules() if isinstance(m, QuantizedExperts)),
                default=0)  # fmt: skip
    if fused:  # per-expert tensors read, stacked and concatenated into the fused gate/up projection
        terms["fused experts being read: twice their gate/up projection"] = 2 * fused
        blocks_phase += 2 * fused
    if config.needs_calibration and calibrates_blocks(config):
        hidden = _setting(shell, "hidden_size")
        sizes = _linear_sizes(blocks[0])
        terms["input embedding"] = _embedding_bytes(shell, itemsize)
        samples, seq_len = config.calibration_samples, config.calibration_seq_len
        held = min(samples, BATCH_SIZE) if offloaded else samples
        terms["calibration activations"] = 2 * held * seq_len * hidden * itemsize
        wide = (
            3 * _setting(shell, "intermediate_size", 4 * hidden)
            + 2 * _setting(shell, "num_attention_heads", 1) * seq_len
        )
        widest_in, widest_out = max(sizes, default=(0, 0), key=lambda s: s[0])
        summing = {
            "input statistics, summed in float64": sum(8 * i * i for i, _ in sizes),
            "forward temporaries": BATCH_SIZE * seq_len * wide * itemsize,
            "one panel of X^T X": 4 * widest_in * min(widest_in, InputStats.PRODUCT_COLUMNS),
        }
        solving = {
            "input statistics, float32 means": sum(4 * i * i for i, _ in sizes),
            "solver working set": 8 * widest_in**2 + 8 * widest_in * widest_out,
        }
        larger = max(summing, solving, key=lambda phase: sum(phase.values()))
        terms.update(larger)
        blocks_phase += sum(terms[k] for k in list(terms)[4 if fused else 3 :])
    end_phase = outside_float + outside_stored
    terms["tensors outside the blocks, float and quantized (at the end)"] = end_phase
    return MemoryPrediction(before + max(blocks_phase, end_phase), terms)


def _linear_sizes(block: nn.Module) -> list[tuple[int, int]]:
    """(inputs, outputs) of every Linear layer of `block`, each expert's slice of a fused projection one."""
    sizes = [(m.in_features, m.out_features) for m in block.modules() if isinstance(m, (nn.Linear, QuantizedLinear))]
    for module in block.modules():
        if isinstance(module, QuantizedExperts):
            slices = [(layout.in_features, layout.out_features) for layout in module.layouts.values()]
            sizes += slices * module.num_experts
    return sizes


def _float_bytes(module: nn.Module, itemsize: int) -> int:
    return sum(_own_float_bytes(m, itemsize) for m in module.modules())


def _stored_bytes(module: nn.Module) -> int:
    return sum(_own_stored_bytes(m) for m in module.modules())


def _own_float_bytes(module: nn.Module, itemsize: int) -> int:
    """What `module`'s own tensors take in float: a quantized layer's weight as the float one it replaces."""
    total = sum(p.numel() * itemsize for p in module._parameters.values() if p is not None)
    if isinstance(module, QuantizedLinear | QuantizedTable | QuantizedExperts):
        total += module.in_features * module.out_features * itemsize
    return total


def _own_stored_bytes(module: nn.Module) -> int:
    tensors = list(module._parameters.values()) + list(module._buffers.values())
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _embedding_bytes(shell: nn.Module, itemsize: int) -> int:
    embedding = shell.get_input_embeddings() if hasattr(shell, "get_input_embeddings") else None
    if embedding is None:
        return 0
    if isinstance(embedding, QuantizedTable):
        return embedding.in_features * embedding.out_features * itemsize
    return sum(p.numel() for p in embedding.parameters()) * itemsize


def _setting(shell: nn.Module, name: str, default: Any = 0) -> int:
    config = getattr(shell, "config", None)
    value = getattr(config, name, None)
    return int(value) if isinstance(value, int) else int(default)
