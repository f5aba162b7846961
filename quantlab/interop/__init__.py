"""Checkpoints other libraries write, in quantlab's storage: compressed-tensors (llm-compressor, vLLM),
GPTQ (AutoGPTQ, GPTQModel) and AWQ's GEMM packing (AutoAWQ, GPTQModel).

`quantlab_checkpoint(folder)` gives the folder quantlab loads: `folder` itself, or, for a checkpoint
whose `quant_method` is "compressed-tensors", "gptq" or "awq", a temporary quantlab checkpoint converted
from it with the same codes and scales (`quantlab.interop.checkpoint`), so every command that opens
a model runs such checkpoints on quantlab's kernels. The formats' facts are in
`quantlab.interop.compressed_tensors` (shared with the exporter), `quantlab.interop.gptq` and `quantlab.interop.awq`.
"""

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

from quantlab.interop import awq, compressed_tensors, gptq
from quantlab.interop.errors import ForeignCheckpointError

FOREIGN_METHODS = (compressed_tensors.QUANT_METHOD, gptq.QUANT_METHOD, awq.QUANT_METHOD)

__all__ = ["FOREIGN_METHODS", "ForeignCheckpointError", "foreign_method", "quantlab_checkpoint"]


def foreign_method(folder: Path) -> str | None:
    """The `quant_method` of a checkpoint quantlab reads into its own storage (`FOREIGN_METHODS`), or None
    for any other folder."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # loading reports what is wrong with it
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    return method if method in FOREIGN_METHODS else None


@contextlib.contextmanager
def quantlab_checkpoint(folder: Path, scratch: Path | None = None) -> Iterator[Path]:
    """`folder`, or its conversion into a temporary quantlab checkpoint under `scratch` (default: the
    system's temporary folder), removed when the block ends."""
    if foreign_method(folder) is None:
        yield folder
        return
    from quantlab.interop.checkpoint import convert_checkpoint
    from quantlab.utils.atomic import scratch_directory

    with scratch_directory(
        scratch if scratch is not None else Path(tempfile.gettempdir()), "quantlab-import"
    ) as target:
        convert_checkpoint(Path(folder), target)
        yield target
