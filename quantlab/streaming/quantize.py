"""Quantize a safetensors checkpoint into a checkpoint folder with one decoder block in memory at a time.

The model is built on the meta device; the embeddings are read for the calibration's input
stage, then each block in turn is read (converted to the float dtype `from_pretrained` would
use), quantized (round to nearest, or the calibrated schedule of `quantlab.calibration` with the
inputs of block i+1 computed by the quantized block i), written to its place in the output
shards, and dropped. The tensors outside the blocks (embeddings, final norm, output head) are
quantized and written last. Mixed precision walks the blocks once more before quantizing to
measure them, and its empirical Fisher runs the whole model forward and backward one
checkpointed block at a time; self-calibration samples its text from the model run the same
way (each block read for every step of generation: slow on large models, but bounded).

The result is the checkpoint the in-memory path (`from_pretrained(..., quantization_config=)`
then `save_pretrained`) writes, tensor for tensor and byte for byte, built in a resumable staging
folder (`quantlab.streaming.partial`) and renamed into place at the end.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from quantlab.calibration.allocation import allocate_bits, check_budget_reachable
from quantlab.calibration.blocks import Activations, OffloadedActivations, find_blocks
from quantlab.calibration.model import windows_for
from quantlab.calibration.sequential import quantize_blocks
from quantlab.config import QuantlabConfig
from quantlab.errors import QuantizationError
from quantlab.plan import QuantizationPlan, build_plan, empty_layers
from quantlab.replacement import replace_experts, replace_linear_layers
from quantlab.streaming.blocks import REST, ReadBlocks, StreamedBlocks, write_part
from quantlab.streaming.partial import WINDOWS, PartialOutput, ResumeError
from quantlab.streaming.reader import CheckpointReader, NotStreamableError
from quantlab.streaming.skeleton import StreamedWeights, empty_model, outside_blocks
from quantlab.streaming.writer import DEFAULT_SHARD_BYTES, SafetensorsWriter, shard_plan
from quantlab.utils.allocator import map_large_allocations
from quantlab.utils.atomic import commit_directory
from quantlab.vocabulary import replace_vocabulary

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

Note = Callable[[str], None]


@dataclasses.dataclass
class StreamedQuantization:
    """What a streamed quantization made: the output's model on the meta device (its quantized layers
    with their final configs, for reports) and the complete folder before it is renamed into place."""

    model: nn.Module
    folder: Path
    blocks_name: str  # where the decoder blocks are in `model`
    plan: QuantizationPlan | None = None  # what was planned (with mixed precision's choices)


def quantize_checkpoint(
    folder: Path,
    hf_config: "PretrainedConfig",
    cls: type,
    config: QuantlabConfig,
    output: Path,
    *,
    tokenizer: "PreTrainedTokenizerBase | None" = None,
    resume: bool = False,
    overwrite: bool = False,
    protect: list[Path] | None = None,
    before_commit: Callable[[StreamedQuantization], None] | None = None,
    progress: bool = False,
    note: Note = lambda message: None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    offload_dir: Path | None = None,
) -> StreamedQuantization:
    """Quantize the float safetensors checkpoint in `folder` with `config` into `output`, block by block.

    `before_commit(result)` runs on the complete folder before it is renamed to `output`.
    `resume`: continue an interrupted run of the same source and config (its finished blocks are
    checked by hash). `offload_dir`: keep the calibration activations in files there (one batch in
    memory at a time) rather than in memory. Raises `NotStreamableError` before any work when the
    checkpoint cannot be read tensor by tensor (no safetensors files, tensor names that differ from the model's).
    Large allocations are served by their own memory maps from here on (`map_large_allocations`), so
    the peak does not creep with the number of blocks.
    """
    map_large_allocations()
    reader = CheckpointReader(folder)
    with contextlib.closing(reader):
        dtype = load_dtype(hf_config, reader)
        model = empty_model(cls, hf_config, dtype, folder)
        weights = StreamedWeights(model, reader, dtype)
        try:
            prefix, blocks = find_blocks(model)
        except QuantizationError as error:
            raise NotStreamableError(str(error)) from error
        plan = build_plan(model, config)
        plan.warn()
        with PartialOutput.start(output, reader.fingerprint(), config.to_dict(), resume, note) as partial:
            try:
                activations = OffloadedActivations(offload_dir) if offload_dir is not None else Activations()
                result = _run(
                    weights,
                    blocks,
                    prefix,
                    plan,
                    partial,
                    tokenizer,
                    progress,
                    max_shard_bytes,
                    activations,
                )
            except BaseException:
                if partial.manifest["done"]:
                    finished = len(partial.manifest["done"])
                    note(f"stopped with {finished} part(s) of {output} finished: rerun with --resume to continue")
                else:
                    partial.discard()
                raise
            try:  # the work is done: whatever happens now, nothing is left to resume
                if before_commit is not None:
                    before_commit(result)
                commit_directory(partial.folder, output, overwrite, protect or [])
            finally:
                partial.discard()
    return StreamedQuantization(result.model, output, result.blocks_name, result.plan)


def _run(
    weights: StreamedWeights,
    blocks: nn.ModuleList,
    prefix: str,
    plan: QuantizationPlan,
    partial: PartialOutput,
    tokenizer: Any,
    progress: bool,
    max_shard_bytes: int,
    activations: Activations,
) -> StreamedQuantization:
    model, config = weights.model, plan.config
    if plan.allocates and partial.resolved_config is None:
        check_budget_reachable(model, plan)
    windows = None
    if plan.needs_calibration:
        windows = _windows(weights, blocks, prefix, config, partial, tokenizer, progress)
    if plan.allocates:
        _allocate(weights, blocks, prefix, plan, partial, windows, progress)
    shell = output_model(type(model), model.config, plan, weights.dtype, Path(model.name_or_path))
    writer = _writer(shell, partial, max_shard_bytes)
    with contextlib.closing(writer):
        streamed = StreamedBlocks(weights, blocks, prefix, writer, partial, shell)
        if partial.manifest["done"]:
            streamed.verify_finished()
        if all(streamed.finished(index) for index in range(len(blocks))):
            pass  # resumed after the last block: nothing to recompute
        elif plan.needs_calibration and plan.calibrates_blocks:
            _input_stage(weights, model, blocks, load=True)
            quantize_blocks(model, plan, windows, progress, streamed, activations)
        else:
            _data_free_blocks(streamed, plan, progress)
        if not partial.finished(REST):
            _quantize_rest(weights, blocks, prefix, plan, writer, partial)
        writer.write_index(shell.num_parameters())
    _write_configs(shell, config, partial.folder, tokenizer)
    partial.remove_bookkeeping()
    return StreamedQuantization(shell, partial.folder, prefix, plan)


def load_dtype(hf_config: "PretrainedConfig", reader: CheckpointReader) -> torch.dtype:
    """The dtype `from_pretrained` loads into without `dtype=` ("auto"): the config's, else the first float
    tensor's in the checkpoint."""
    dtype = getattr(hf_config, "dtype", None)
    if dtype is None:
        floats = (reader.entries[name].dtype for name in reader.names() if reader.entries[name].dtype.is_floating_point)
        dtype = next(floats, torch.get_default_dtype())
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def output_model(
    cls: type, hf_config: "PretrainedConfig", plan: QuantizationPlan, dtype: torch.dtype, folder: Path
) -> nn.Module:
    """The quantized model on the meta device, as transformers builds it to reload the output: its
    `state_dict` names the tensors the output stores, with their shapes and dtypes."""
    shell = empty_model(cls, hf_config, dtype, folder)
    shell.tie_weights()
    empty_layers(shell, plan)
    return shell


def stored_layout(shell: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor `save_pretrained` would write for `shell` (tied copies left out)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = remove_tied_weights_from_state_dict(shell.state_dict(), shell)
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}


def _writer(shell: nn.Module, partial: PartialOutput, max_shard_bytes: int) -> SafetensorsWriter:
    headers, slots = shard_plan(stored_layout(shell), {"format": "pt"}, max_shard_bytes)
    writer = SafetensorsWriter(partial.folder, headers, slots)
    if not partial.manifest["done"]:
        with _closed_on_error(writer):
            writer.create()
    elif not writer.matches_files():
        raise ResumeError(
            f"the output files in {partial.folder.name} do not have the layout this run writes (damaged, or "
            f"written by another version); rerun without --resume to start over"
        )
    return writer


@contextlib.contextmanager
def _closed_on_error(writer: SafetensorsWriter) -> Iterator[None]:
    try:
        yield
    except BaseException:
        writer.close()
        raise


def _windows(
    weights: StreamedWeights,
    blocks: nn.ModuleList,
    prefix: str,
    config: QuantlabConfig,
    partial: PartialOutput,
    tokenizer: Any,
    progress: bool,
) -> torch.Tensor:
    """The calibration windows: kept in the staging folder, so a resumed run calibrates on the same ones."""
    from safetensors.torch import load_file, save_file

    path = partial.folder / WINDOWS
    if path.is_file() and partial.manifest.get("windows"):
        return load_file(path)["windows"]
    if tokenizer is None and not config.self_calibration:
        raise QuantizationError(
            f"calibrating reads text, and {weights.model.name_or_path} has no tokenizer to read it with; save the "
            f"tokenizer beside the checkpoint, or calibrate on the model's own text with --self-calibration"
        )
    streamed = ReadBlocks(weights, blocks, prefix)
    windows = windows_for(weights.model, config, None, tokenizer, progress, streamed)
    save_file({"windows": windows.contiguous()}, path)
    partial.manifest["windows"] = True
    partial.save()
    return windows


def _allocate(
    weights: StreamedWeights,
    blocks: nn.ModuleList,
    prefix: str,
    plan: QuantizationPlan,
    partial: PartialOutput,
    windows: torch.Tensor,
    progress: bool,
) -> None:
    """Mixed precision's per-layer choices, measured on the streamed float model (or as an earlier run chose them)."""
    if partial.resolved_config is not None:
        plan.set_layer_options(partial.resolved_config.get("layer_options"))
        return
    _input_stage(weights, weights.model, blocks, load=True)
    measured = ReadBlocks(weights, blocks, prefix)
    plan.set_layer_options(allocate_bits(weights.model, plan, windows, progress, measured))
    _input_stage(weights, weights.model, blocks, load=False)
    partial.set_resolved_config(plan.config.to_dict())


def _data_free_blocks(streamed: StreamedBlocks, plan: QuantizationPlan, progress: bool) -> None:
    """Round to nearest (or another data-free solver) one block at a time."""
    from tqdm.auto import tqdm

    model = streamed.weights.model
    for index, block in enumerate(tqdm(streamed.blocks, desc="quantizing blocks", disable=not progress)):
        if streamed.finished(index):
            continue
        streamed.load(index, block)
        part = f"{streamed.part(index)}."
        replace_linear_layers(model, plan.config, plan.module_class, _within(part, plan.selects), quantize=True)
        experts = [name for name in plan.experts_modules if name.startswith(part)]
        replace_experts(model, plan.config, plan.module_class, experts, quantize=True)
        streamed.store(index, block)


def _within(prefix: str, selected: Callable[[str], bool]) -> Callable[[str], bool]:
    return lambda name: name.startswith(prefix) and selected(name)


def _input_stage(weights: StreamedWeights, model: nn.Module, blocks: nn.ModuleList, load: bool) -> None:
    """Read (or drop) the tensors outside the blocks but the output head: what runs before the first block."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in outside_blocks(model, blocks):
        if module is head:
            continue
        if load:
            weights.load(module, name, recurse=False)
        else:
            weights.release(module, recurse=False)


def _quantize_rest(
    weights: StreamedWeights,
    blocks: nn.ModuleList,
    prefix: str,
    plan: QuantizationPlan,
    writer: SafetensorsWriter,
    partial: PartialOutput,
) -> None:
    """The tensors outside the blocks: the output head (data-free, if quantized), the vocabulary tables
    (`embedding_bits`), the rest in float."""
    model = weights.model
    inside = f"{prefix}."
    for name, module in outside_blocks(model, blocks):
        weights.load(module, name, recurse=False)
    outside = lambda name: not name.startswith(inside) and plan.selects(name)  # noqa: E731
    replace_linear_layers(model, plan.data_free, plan.module_class, outside, quantize=True)
    replace_vocabulary(model, plan.config, quantize=True)
    state = model.state_dict()
    tensors = {name: state[name] for name in writer.slots if not name.startswith(inside)}
    partial.complete(REST, write_part(writer, tensors, "", prefix))


def _write_configs(shell: nn.Module, config: QuantlabConfig, folder: Path, tokenizer: Any) -> None:
    """config.json (with the quantization config), generation_config.json and the tokenizer, as
    `save_pretrained` writes them for the quantized model."""
    from quantlab.loading import io_errors_as_os_errors

    shell.config.quantization_config = config
    shell.config.dtype = str(shell.dtype).split(".")[1]
    shell.config.architectures = [type(shell).__name__]
    with io_errors_as_os_errors(folder):
        shell.config.save_pretrained(folder)
        if shell.can_generate():
            shell.generation_config.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
