"""Export a float or quantlab-quantized checkpoint to another runtime's format.

ONNX (`export_onnx`): quantized layers become onnxruntime low-bit operators carrying the
checkpoint's own codes and scales (MatMulNBits, MatMulBnb4, or a dequantize fallback);
`ort_dynamic_int8` instead runs onnxruntime's own dynamic int8 quantization on a float export,
for comparison. Large weights go to a `.data` file beside it (see `quantlab.export`).

GGUF (`export_gguf`): one file llama.cpp runs, with the model's tokenizer; layers whose codes a
GGUF type holds keep them, the rest is re-quantized and reported (see `quantlab.export.gguf`).

compressed-tensors (`export_compressed_tensors`): a checkpoint folder transformers and vLLM load
with the `compressed-tensors` package, quantlab's int4/int8 codes kept; a layer no scheme holds
exactly is refused (see `quantlab.export.compressed_tensors`). Every output is written atomically, and may
not be, contain or lie inside the model it is exported from.
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantlab.loading import ModelSource, resolve_model
from quantlab.workflows.notes import Notify, notifier
from quantlab.workflows.outputs import check_output


@dataclass
class ExportReport:
    """The exported file or folder (`result`: the ONNX, GGUF or compressed-tensors exporter's result) and the
    time loading and exporting took."""

    model: str
    result: Any
    load_seconds: float
    export_seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            **self.result.to_json(),
            "load_seconds": self.load_seconds,
            "export_seconds": self.export_seconds,
        }


def export_onnx(
    model: "str | os.PathLike | ModelSource | None",
    output: str | os.PathLike,
    *,
    with_past: bool = False,
    ort_dynamic_int8: bool = False,
    accuracy_level: int = 0,
    overwrite: bool = False,
    progress: bool = False,
    notify: Notify | None = None,
) -> ExportReport:
    """Write `model` (a folder, a `.gguf` file, None for the embedded default) to the ONNX file `output`."""
    import torch

    from quantlab.export import to_onnx
    from quantlab.export.onnx.saving import data_file
    from quantlab.loading import load
    from quantlab.utils.atomic import check_not_input

    output = Path(output).expanduser()
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    check_output(output, overwrite, source.path)
    check_not_input(data_file(output), [source.path])  # the side file large weights go to
    started = time.perf_counter()
    loaded_model = load(source, dtype=torch.float32, scratch=output.parent, progress=progress)
    loaded = time.perf_counter()
    notifier(notify)(f"exporting {source} to {output}")
    result = to_onnx(
        loaded_model,
        output,
        with_past=with_past,
        ort_dynamic_int8=ort_dynamic_int8,
        accuracy_level=accuracy_level,
        overwrite=overwrite,
    )
    return ExportReport(str(source), result, loaded - started, time.perf_counter() - loaded)


def export_gguf(
    model: "str | os.PathLike | ModelSource | None",
    output: str | os.PathLike,
    *,
    fallback_type: str | None = None,
    exact: bool = False,
    overwrite: bool = False,
    progress: bool = False,
    notify: Notify | None = None,
) -> ExportReport:
    """Write `model` (a folder, a `.gguf` file, None for the embedded default) and its tokenizer to the
    GGUF file `output`; arguments checked before the model loads, nothing written on an error."""
    import torch

    from quantlab.export.gguf import FALLBACK_TYPES, GGUFExportError, to_gguf
    from quantlab.loading import load_with_tokenizer

    output = Path(output).expanduser()
    if fallback_type is not None and fallback_type not in FALLBACK_TYPES:
        raise GGUFExportError(f"fallback type {fallback_type!r} is not one of {', '.join(FALLBACK_TYPES)}")
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    check_output(output, overwrite, source.path)
    if output.is_dir():
        raise GGUFExportError(f"output {output} is a folder; name the .gguf file to write")
    started = time.perf_counter()
    loaded = load_with_tokenizer(source, dtype=torch.float32, scratch=output.parent, progress=progress)
    load_seconds = time.perf_counter() - started
    notifier(notify)(f"exporting {source} to {output}")
    result = to_gguf(
        loaded.model,
        output,
        tokenizer=loaded.tokenizer,
        fallback_type=fallback_type,
        exact=exact,
        overwrite=overwrite,
        name=source.name or None,
    )
    return ExportReport(str(source), result, load_seconds, time.perf_counter() - started - load_seconds)


def export_compressed_tensors(
    model: "str | os.PathLike | ModelSource | None",
    output: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool = False,
    notify: Notify | None = None,
) -> ExportReport:
    """Write `model` (a quantized folder, None for the embedded default) and its tokenizer to the folder
    `output` as a compressed-tensors checkpoint; the output checked before the model loads, nothing
    written on an error."""
    import torch

    from quantlab.export.compressed_tensors import to_compressed_tensors
    from quantlab.loading import load_with_tokenizer

    output = Path(output).expanduser()
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    check_output(output, overwrite, source.path)
    started = time.perf_counter()
    loaded = load_with_tokenizer(source, dtype=torch.float32, scratch=output.parent, progress=progress)
    load_seconds = time.perf_counter() - started
    notifier(notify)(f"exporting {source} to {output}")
    result = to_compressed_tensors(loaded.model, output, tokenizer=loaded.tokenizer, overwrite=overwrite)
    return ExportReport(str(source), result, load_seconds, time.perf_counter() - started - load_seconds)
