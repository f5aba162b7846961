"""compressed-tensors export: a quantlab model as the checkpoint transformers and vLLM read with the
`compressed-tensors` package, quantlab's codes and scales kept.

`to_compressed_tensors(model, folder, tokenizer=...)` writes every quantized Linear layer whose
numbers are an integer grid (`Codec.integer_grid`: symmetric int4/int8, and zero points where they
are whole numbers) as "pack-quantized" tensors; float layers stay float and are listed in `ignore`.
A layer no compressed-tensors scheme holds exactly (NF4, fractional zero points, other widths,
padded groups) stops the export with its name and the reason. The format's own facts live in
`quantlab.interop.compressed_tensors`, which the importer shares.
"""

from quantlab.export.compressed_tensors.exporter import (
    CompressedTensorsExport,
    CompressedTensorsExportError,
    ExportedLayer,
    to_compressed_tensors,
)

__all__ = ["CompressedTensorsExport", "CompressedTensorsExportError", "ExportedLayer", "to_compressed_tensors"]
