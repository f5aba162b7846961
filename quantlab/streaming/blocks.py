"""The calibration schedule's `BlockWeights` for a streamed model: read a block, quantize it, write it, drop it.

Block i is read from the float checkpoint when its turn comes; once quantized, its stored tensors
(quantized layers' codes and scales, norms, biases) go straight to their places in the output
shards, their hash to the resume manifest, and the block is emptied. A block an earlier run
finished (`--resume`) is read back from the output instead, its quantized layers dequantized into
its float Linear layers, exactly as the schedule leaves a block after quantizing it, so its
outputs, the next block's inputs, are the ones the uninterrupted run computed.
"""

import contextlib
import hashlib

import torch
from torch import nn

from quantlab.calibration.blocks import BlockWeights
from quantlab.nn import QuantizedLinear
from quantlab.nn.kinds import is_transposed_linear, linear_weight
from quantlab.nn.quantized_experts import PROJECTIONS, QuantizedExperts
from quantlab.streaming.partial import PartialOutput, ResumeError
from quantlab.streaming.skeleton import StreamedWeights, assign, stored_entries
from quantlab.streaming.writer import SafetensorsWriter

REST = "outside the blocks"  # the manifest's name for the tensors outside the blocks


class ReadBlocks(BlockWeights):
    """Blocks of `weights.model` (under `prefix`) read from the float checkpoint, to be measured only."""

    def __init__(self, weights: StreamedWeights, blocks: nn.ModuleList, prefix: str) -> None:
        self.weights, self.blocks, self.prefix = weights, blocks, prefix

    def part(self, index: int) -> str:
        return f"{self.prefix}.{index}"

    def load(self, index: int, block: nn.Module) -> None:
        self.weights.load(block, self.part(index))

    def release(self, index: int, block: nn.Module) -> None:
        self.weights.release(block)

    def whole_model(self) -> contextlib.AbstractContextManager[None]:
        return self.weights.on_demand(self.blocks, self.prefix)


class StreamedBlocks(ReadBlocks):
    """Blocks read from the checkpoint, quantized, and written to `writer` (their hashes to `partial`)."""

    def __init__(
        self,
        weights: StreamedWeights,
        blocks: nn.ModuleList,
        prefix: str,
        writer: SafetensorsWriter,
        partial: PartialOutput,
        shell: nn.Module,
    ) -> None:
        super().__init__(weights, blocks, prefix)
        self.writer, self.partial, self.shell = writer, partial, shell

    def load(self, index: int, block: nn.Module) -> None:
        if self.finished(index):
            self._load_stored(index, block)
        else:
            self.weights.load(block, self.part(index))

    def finished(self, index: int) -> bool:
        return self.partial.finished(self.part(index))

    def store(self, index: int, block: nn.Module) -> None:
        if not self.finished(index):
            prefix = f"{self.part(index)}."
            tensors = {prefix + name: tensor for name, tensor in block.state_dict().items()}
            self.partial.complete(self.part(index), write_part(self.writer, tensors, prefix))
        self.weights.release(block)

    def verify_finished(self) -> None:
        """Every part the manifest lists as finished must hash as it did when written."""
        for part in list(self.partial.manifest["done"]):
            names = part_names(self.writer, "", self.prefix) if part == REST else part_names(self.writer, f"{part}.")
            if stored_digest(self.writer, names) != self.partial.digest(part):
                raise ResumeError(
                    f"the stored tensors of {part} in {self.partial.folder.name} do not match their hash (damaged or "
                    f"edited); rerun without --resume to start over"
                )

    def _load_stored(self, index: int, block: nn.Module) -> None:
        """Block `index` as the earlier run left it: stored float tensors, quantized layers dequantized."""
        name = self.part(index)
        shell_block = self.shell.get_submodule(name)
        for full, owner, attribute in stored_entries(block, name):
            layer = full.rpartition(".")[0]
            relative = layer.removeprefix(f"{name}.")
            quantized = shell_block.get_submodule(relative) if relative != layer else None
            if isinstance(quantized, QuantizedLinear) and attribute == "weight":
                value = linear_weight(self._dequantized(quantized, layer), is_transposed_linear(owner))
            elif isinstance(quantized, QuantizedExperts) and attribute in PROJECTIONS:
                value = self._dequantized_experts(quantized, layer, attribute)
            else:
                value = self.writer.read(full)
            assign(owner, attribute, value.to(self.weights.dtype) if value.is_floating_point() else value)

    def _dequantized(self, shell_layer: QuantizedLinear, layer: str) -> torch.Tensor:
        cls = type(shell_layer)
        real = cls(shell_layer.in_features, shell_layer.out_features, False, shell_layer.config, device="cpu")
        real.load_stored({tensor: self.writer.read(f"{layer}.{tensor}") for tensor in real.stored_names})
        return real.dequantize_weight(self.weights.dtype)

    def _dequantized_experts(self, shell: QuantizedExperts, layer: str, projection: str) -> torch.Tensor:
        experts = QuantizedExperts(
            shell.num_experts, shell.hidden_size, shell.intermediate_size, shell.act_fn, shell.layer_class,
            shell.configs, device="cpu",
        )  # fmt: skip
        names = [name for name in experts.stored_names if name == projection or name.startswith(f"{projection}_")]
        experts.load_stored({name: self.writer.read(f"{layer}.{name}") for name in names})
        return experts.dequantize_projection(projection, self.weights.dtype)


def part_names(writer: SafetensorsWriter, prefix: str, blocks_prefix: str | None = None) -> list[str]:
    """The output tensors of one part: those under `prefix`, or (with `blocks_prefix`) all outside the blocks."""
    if blocks_prefix is not None:
        return sorted(n for n in writer.slots if not n.startswith(f"{blocks_prefix}."))
    return sorted(n for n in writer.slots if n.startswith(prefix))


def write_part(
    writer: SafetensorsWriter, tensors: dict[str, torch.Tensor], prefix: str, blocks_prefix: str | None = None
) -> str:
    """Write one part's tensors (all of them: the layout's names must be exactly these); returns its hash."""
    expected = part_names(writer, prefix, blocks_prefix)
    if sorted(tensors) != expected:
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise RuntimeError(
            f"the quantized part does not match the output's layout (missing {missing[:3]}, extra {extra[:3]})"
        )
    digest = hashlib.sha256()
    for name in expected:
        digest.update(name.encode() + writer.write(name, tensors[name]).encode())
    writer.sync()
    return digest.hexdigest()


def stored_digest(writer: SafetensorsWriter, names: list[str]) -> str:
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + writer.read_digest(name).encode())
    return digest.hexdigest()
