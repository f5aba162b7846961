"""Export a float or quantlab-quantized checkpoint to one ONNX file for onnxruntime.

Quantized layers become onnxruntime low-bit operators carrying the checkpoint's own codes and
scales (MatMulNBits, MatMulBnb4, or a dequantize fallback); `ort_dynamic_int8` instead runs
onnxruntime's own dynamic int8 quantization on a float export, for comparison. The file is
written atomically; large weights go to a `.data` file beside it (see `quantlab.export`).
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantlab.loading import ModelSource, resolve_model
from quantlab.workflows.notes import Notify, notifier


@dataclass
class ExportReport:
    """The exported file (`result`, a `quantlab.export` result) and the time loading and exporting took."""

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
    from quantlab.loading import load
    from quantlab.utils.atomic import OutputExistsError

    output = Path(output).expanduser()
    if output.exists() and not overwrite:
        raise OutputExistsError(f"output {output} already exists; pass --overwrite to replace it, or pick another")
    source = model if isinstance(model, ModelSource) else resolve_model(model)
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
