"""compressed-tensors export: a quantlab model as the checkpoint transformers and vLLM read with the
`compressed-tensors` package, quantlab's codes and scales kept.

`to_compressed_tensors(model, folder, tokenizer=...)` writes every quantized Linear layer whose
numbers are an integer grid (`Codec.integer_grid`: symmetric int4/int8, and zero points where they
are whole numbers) as "pack-quantized" tensors; float layers stay float and are listed in `ignore`.
A layer no compressed-tensors scheme holds exactly (NF4, fractional zero points, other widths,
padded groups) stops the export with its name and the reason. The format's own facts live in
`quantlab.interop.compressed_tensors`, which the importer shares.

A mixture of experts' quantized projections (`QuantizedExperts`) are written as the per-expert Linear
layers transformers' checkpoint conversion names for the architecture (`experts.3.gate_proj`, `.up_proj`,
`.down_proj`; Mixtral's `block_sparse_moe.experts.3.w1`, ...), gate and up split from `gate_up_proj`,
each packed as a Linear layer is. transformers' compressed-tensors loader decodes experts to float while
loading, with one scheme for all of them and no zero points: experts in several schemes or asymmetric
ones are refused, and their scales are written in the model's float dtype (the export's notes say so).
"""

from quantlab.export.compressed_tensors.exporter import (
    CompressedTensorsExport,
    CompressedTensorsExportError,
    ExportedLayer,
    to_compressed_tensors,
)

__all__ = ["CompressedTensorsExport", "CompressedTensorsExportError", "ExportedLayer", "to_compressed_tensors"]
