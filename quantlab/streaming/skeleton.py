"""A model on the meta device whose parts are read from the checkpoint only while they are needed.

`empty_model` builds the transformers model from its config with every parameter on the meta
device (no memory) and the buffers computed at construction (rotary frequencies) real, as
`from_pretrained` would before reading weights. `StreamedWeights` then fills one module (a
decoder block, the embeddings) from a `CheckpointReader`, converting to the model's dtype as
`from_pretrained` does, and empties it again; a parameter tied to another (an output head tied
to the embedding) shares its tensor. `on_demand` makes a whole-model forward (or forward and
backward) run with one block in memory at a time: each block is read when it is called and
emptied when it returns; under autograd the block is checkpointed (its forward runs again, with
its weights read again, when the backward pass reaches it), so the graph never holds more than
the block being differentiated.
"""

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from quantlab.streaming.conversion import CheckpointConversion
from quantlab.streaming.reader import CheckpointReader, NotStreamableError
from quantlab.utils.allocator import return_freed_memory


def empty_model(cls: type, hf_config: Any, dtype: torch.dtype, folder: Path) -> Any:
    """`cls` built from `hf_config` with its parameters on the meta device, in eval mode, as if loaded from `folder`."""
    from accelerate import init_empty_weights
    from transformers import GenerationConfig

    with init_empty_weights(include_buffers=False):
        if hasattr(cls, "_from_config"):
            model = cls._from_config(hf_config, dtype=dtype)
        else:  # an auto class
            model = cls.from_config(hf_config, dtype=dtype)
    model.config._name_or_path = str(folder)
    model.name_or_path = str(folder)
    if model.can_generate() and (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    return model.eval()


def stored_entries(module: nn.Module, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Module, str]]:
    """(full name, owning module, attribute) of every parameter and persistent buffer of `module`, and
    with `recurse` of its submodules."""
    owners = module.named_modules(prefix=prefix, remove_duplicate=False) if recurse else [(prefix, module)]
    for name, owner in owners:
        for attribute, value in owner._parameters.items():
            if value is not None:
                yield (f"{name}.{attribute}" if name else attribute), owner, attribute
        for attribute, value in owner._buffers.items():
            if value is not None and attribute not in owner._non_persistent_buffers_set:
                yield (f"{name}.{attribute}" if name else attribute), owner, attribute


def is_empty(module: nn.Module, recurse: bool = True) -> bool:
    return any(getattr(owner, attribute).is_meta for _, owner, attribute in stored_entries(module, "", recurse))


class StreamedWeights:
    """Fills and empties parts of a meta-device `model` from `reader`, in `dtype`."""

    def __init__(self, model: nn.Module, reader: CheckpointReader, dtype: torch.dtype) -> None:
        self.model, self.reader, self.dtype = model, reader, dtype
        self.tied: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
        self.conversion = CheckpointConversion(model, reader.names())
        self.check_names()

    def check_names(self) -> None:
        """Every tensor the model stores must be in the checkpoint under its own name (or its tied source's), or
        be built from checkpoint tensors by the model's conversion mapping (fused experts)."""
        for name, _, _ in stored_entries(self.model):
            if name not in self.reader and self.tied.get(name) not in self.reader and name not in self.conversion:
                raise NotStreamableError(f"the checkpoint has no tensor {name!r} (its names differ from the model's)")

    def load(self, module: nn.Module, prefix: str, recurse: bool = True) -> None:
        """Read every empty parameter and buffer of `module` (named `prefix` in the model; with `recurse`,
        of its submodules too)."""
        for name, owner, attribute in stored_entries(module, prefix, recurse):
            current = getattr(owner, attribute)
            if not current.is_meta:
                continue
            value = self._shared(name)
            dtype = self.dtype if current.is_floating_point() else None
            if value is None and name not in self.reader and name in self.conversion:
                value = self.conversion.read(name, lambda key, dtype=dtype: self.reader.tensor(key, dtype))
            elif value is None:
                key = name if name in self.reader else self.tied[name]
                value = self.reader.tensor(key, dtype)
            assign(owner, attribute, value)

    def release(self, module: nn.Module, recurse: bool = True) -> None:
        """Empty every parameter and persistent buffer of `module` (back to the meta device)."""
        for _, owner, attribute in stored_entries(module, "", recurse):
            current = getattr(owner, attribute)
            if not current.is_meta:
                assign(owner, attribute, torch.empty_like(current, device="meta"))
        return_freed_memory()

    def _shared(self, name: str) -> torch.Tensor | None:
        """The loaded tensor `name` is tied to, if any (an output head reads the embedding's weight)."""
        source = self.tied.get(name)
        if source is None:
            return None
        tensor = self.model.get_parameter(source)
        return None if tensor.is_meta else tensor

    @contextlib.contextmanager
    def on_demand(self, blocks: nn.ModuleList, prefix: str) -> Iterator[None]:
        """The model runs whole with one block in memory at a time; the rest of it is read for the duration."""
        was_empty = [(name, module) for name, module in outside_blocks(self.model, blocks) if is_empty(module, False)]
        for name, module in was_empty:
            self.load(module, name, recurse=False)
        for index, block in enumerate(blocks):
            block.forward = _streamed_forward(self, block, f"{prefix}.{index}")
        try:
            yield
        finally:
            for block in blocks:
                del block.forward
                self.release(block)
            for _, module in was_empty:
                self.release(module, recurse=False)


def _streamed_forward(weights: StreamedWeights, block: nn.Module, name: str) -> Any:
    original = type(block).forward.__get__(block)

    def run(*args: Any, **kwargs: Any) -> Any:
        weights.load(block, name)
        try:
            return original(*args, **kwargs)
        finally:
            weights.release(block)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(run, *args, use_reentrant=False, **kwargs)
        return run(*args, **kwargs)

    return forward


def outside_blocks(model: nn.Module, blocks: nn.ModuleList) -> list[tuple[str, nn.Module]]:
    """Name and module of every module outside `blocks` (each to be read for its own tensors only)."""
    inside = {id(m) for m in blocks.modules()}
    return [(name, module) for name, module in model.named_modules() if id(module) not in inside]


def assign(owner: nn.Module, attribute: str, value: torch.Tensor) -> None:
    if attribute in owner._parameters:
        owner._parameters[attribute] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[attribute] = value
