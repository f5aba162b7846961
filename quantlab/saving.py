"""Writing a quantized checkpoint atomically: a complete folder at `output_dir`, or nothing there.

`save_quantized` stages `save_pretrained` (and the tokenizer) in a temporary folder beside
`output_dir` and renames it into place only when everything was written, so an interrupted or
failed save (a full disk, Ctrl-C) never leaves a half-written checkpoint that a later
`from_pretrained` would read, and never destroys the folder the model was loaded from.
`AutoModelForCausalLM.from_pretrained(output_dir)` reloads the result in any process where
quantlab is installed.
"""

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantlab.errors import QuantlabError
from quantlab.loading import io_errors_as_os_errors

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class NotQuantizedError(QuantlabError, ValueError):
    """`save_quantized` was given a model with no quantized layer."""


def save_quantized(
    model: "PreTrainedModel",
    output_dir: str | os.PathLike,
    tokenizer: Any = None,
    *,
    overwrite: bool = False,
    protect: Iterable[str | os.PathLike] = (),
    before_commit: Callable[[Path], None] | None = None,
) -> Path:
    """Save a quantized model (and its tokenizer) to `output_dir` atomically; returns `output_dir`.

    `overwrite`: replace an existing `output_dir` (otherwise an existing one is an error).
    `protect`: inputs that must survive; the folder the model was loaded from is always protected.
    `before_commit(staging)`: runs on the complete temporary folder before it is renamed into
    place (e.g. to evaluate the checkpoint as written, or to add a report file); if it raises,
    nothing is written.
    """
    from quantlab.utils.atomic import atomic_directory

    if not is_quantized(model):
        raise NotQuantizedError(
            "the model has no quantized layer; load it with quantization_config= (or quantlab.quantize it) first"
        )
    output = Path(output_dir).expanduser()
    inputs = [*protect, *_loaded_from(model)]
    for path in inputs:
        if output.resolve() == Path(path).resolve():
            raise QuantlabError(f"output {output} is the model's own input {path}; write the checkpoint elsewhere")
    with atomic_directory(output, overwrite=overwrite, protect=inputs) as staging:
        save_checkpoint(model, tokenizer, staging)
        if before_commit is not None:
            before_commit(staging)
    return output


def save_checkpoint(model: Any, tokenizer: Any | None, folder: Path) -> None:
    """`save_pretrained` of the model and tokenizer into `folder`; a full disk surfaces as `OSError(ENOSPC)`."""
    with io_errors_as_os_errors(folder):
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)


def save_model(model: Any, tokenizer: Any | None, output: Path, protect: Iterable[str | os.PathLike] = ()) -> None:
    """Replace `output` atomically: sparse storage when the model carries pruning masks, else `save_pretrained`.

    `protect`: the input models, which replacing `output` must never delete.
    """
    from quantlab.prune import masked_layers, save_sparse
    from quantlab.utils.atomic import atomic_directory

    if masked_layers(model):
        save_sparse(model, output, tokenizer=tokenizer, overwrite=True, protect=list(protect))
        return
    with atomic_directory(output, overwrite=True, protect=list(protect)) as staging:
        save_checkpoint(model, tokenizer, staging)


def is_quantized(model: Any) -> bool:
    """Whether any layer of `model` holds quantized weights (quantlab's layers or tables)."""
    from quantlab.nn import QuantizedLinear
    from quantlab.nn.quantized_embedding import QuantizedTable

    return any(isinstance(module, (QuantizedLinear, QuantizedTable)) for module in model.modules())


def _loaded_from(model: Any) -> list[Path]:
    """The local folder `from_pretrained` read the model from, if it still exists."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or getattr(model, "name_or_path", "")
    path = Path(name) if name else None
    return [path] if path is not None and path.is_dir() else []
