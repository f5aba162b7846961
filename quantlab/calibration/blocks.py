"""The repeated blocks of a model and the inputs of the first one, for block-by-block calibration.

A transformer is an input stage (embeddings), a list of identical blocks, and an output stage.
Calibration runs the input stage once per batch of windows, catches what the first block
receives (hidden states and keyword arguments: attention mask, rotary embeddings, ...), and
from then on only runs one block at a time on those inputs. `BlockWeights` says where each
block's weights are while that happens: already in the model (the default), or read from the
checkpoint when the block's turn comes and written out when it is quantized (`quantlab.streaming`).
"""

import contextlib
import dataclasses
import os
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantlab.errors import QuantizationError
from quantlab.nn.kinds import is_transposed_linear
from quantlab.utils.allocator import heap_for_temporaries


@dataclasses.dataclass
class BlockInputs:
    """One batch of windows as a block sees it."""

    hidden: torch.Tensor
    kwargs: dict[str, Any]


class OffloadedInputs(BlockInputs):
    """One batch whose hidden states wait in a file, read (memory-mapped) each time they are used."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: torch.dtype, kwargs: dict[str, Any]) -> None:
        self.path, self.shape, self.dtype, self.kwargs = path, shape, dtype, kwargs
        weakref.finalize(self, _remove, str(path))

    @property
    def hidden(self) -> torch.Tensor:  # type: ignore[override]
        nbytes = self.dtype.itemsize * int(torch.Size(self.shape).numel())
        raw = torch.from_file(str(self.path), shared=False, size=nbytes, dtype=torch.uint8)
        return raw.view(self.dtype).view(self.shape)


class Activations:
    """Where the calibration activations wait between blocks: in memory."""

    def keep(self, hidden: torch.Tensor, kwargs: dict[str, Any]) -> BlockInputs:
        return BlockInputs(hidden, kwargs)


class OffloadedActivations(Activations):
    """Activations in files under `folder` (one per batch, removed once no batch refers to it), so memory
    holds one batch of them at a time instead of two copies of all."""

    def __init__(self, folder: str | os.PathLike) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix="quantlab-activations-", dir=folder))
        weakref.finalize(self, _remove_folder, str(self.folder))

    def keep(self, hidden: torch.Tensor, kwargs: dict[str, Any]) -> BlockInputs:
        handle, name = tempfile.mkstemp(suffix=".bin", dir=self.folder)
        with os.fdopen(handle, "wb") as file:
            file.write(hidden.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return OffloadedInputs(Path(name), tuple(hidden.shape), hidden.dtype, kwargs)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _remove_folder(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


class BlockWeights:
    """The blocks' weights are in the model already: nothing to read, keep or drop."""

    def load(self, index: int, block: nn.Module) -> None:
        """Make block `index`'s weights real before the schedule uses it."""

    def finished(self, index: int) -> bool:
        """Whether block `index` was quantized and kept by an earlier run (only its outputs are needed)."""
        return False

    def store(self, index: int, block: nn.Module) -> None:
        """Block `index` is done (quantized, or kept in float): keep its result."""

    def release(self, index: int, block: nn.Module) -> None:
        """Block `index` was only measured: drop its weights."""

    def whole_model(self) -> contextlib.AbstractContextManager[None]:
        """The whole float model can run (a forward and backward pass, generation) inside this context."""
        return contextlib.nullcontext()


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The `nn.ModuleList` of repeated blocks holding the most Linear layers, and its name."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(block) for block in module}) != 1:
            continue
        linears = sum(isinstance(m, nn.Linear) or is_transposed_linear(m) for m in module.modules())
        if linears and (best is None or linears > best[0]):
            best = (linears, name, module)
    if best is None:
        raise QuantizationError(
            f"{type(model).__name__} has no list of repeated blocks with Linear layers: calibrated solvers "
            f"quantize block by block; use a data-free solver (rtn, mse) for this model"
        )
    return best[1], best[2]


class _Caught(Exception):
    pass


@torch.no_grad()
def first_block_inputs(
    model: nn.Module,
    first_block: nn.Module,
    windows: torch.Tensor,
    batch_size: int,
    activations: Activations | None = None,
) -> list[BlockInputs]:
    """Run the model's input stage on each batch of windows and keep what `first_block` receives
    (in memory, or where `activations` keeps it)."""
    caught: list[BlockInputs] = []
    keep = (activations or Activations()).keep

    def catch(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        rest = {key: value for key, value in kwargs.items() if key != "hidden_states"}
        caught.append(keep(hidden.detach(), rest))
        raise _Caught

    handle = first_block.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for batch in windows.split(batch_size):
            try:
                model(input_ids=batch.to(_device_of(model)), use_cache=False)
            except _Caught:
                continue
    finally:
        handle.remove()
    if len(caught) != -(-len(windows) // batch_size):
        raise QuantizationError(f"{type(model).__name__}: its first block was not called for every batch")
    return caught


@torch.no_grad()
def run_block(block: nn.Module, inputs: BlockInputs) -> torch.Tensor:
    """The block's output hidden states for one batch."""
    output = block(inputs.hidden, **inputs.kwargs)
    return output[0] if isinstance(output, tuple | list) else output


def run_block_on_batches(
    block: nn.Module,
    batches: list[BlockInputs],
    keep: bool = True,
    each: Callable[[int, torch.Tensor], None] | None = None,
) -> list[torch.Tensor]:
    """The block's output for every batch (kept when `keep`, else an empty list); `each(index, output)` sees
    each output as it is made. The forwards' temporaries come from warm heap pages (`heap_for_temporaries`);
    only the kept outputs, which outlive the pass, are allocated on their own."""
    kept = [torch.empty_like(batch.hidden) for batch in batches] if keep else []
    with heap_for_temporaries():
        for index, batch in enumerate(batches):
            output = run_block(block, batch)
            if each is not None:
                each(index, output)
            if keep:
                kept[index].copy_(output)
    return kept


def _device_of(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
