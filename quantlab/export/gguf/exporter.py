"""`to_gguf`: a causal LM llama.cpp runs, float or quantized by quantlab, as one GGUF file for llama.cpp.

Supported transformers model types (`architectures.ARCHITECTURES`): llama, mistral, mixtral, qwen2, qwen3,
qwen2_moe, qwen3_moe, olmoe, granite, phi3, gemma2, gemma3_text, olmo2, gpt2, gpt_neox, falcon and deepseek_v3;
any other is refused in one line, as is a setting llama.cpp's graph of the architecture cannot express
(`refusals`). The hyperparameter keys are `hyperparameters`' and the tensors `tensors`'.
"""

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from quantlab.export.gguf import architectures
from quantlab.export.gguf.errors import GGUFExportError, require_gguf
from quantlab.export.gguf.hyperparameters import write_hyperparameters
from quantlab.export.gguf.tensors import GGUFTensor, extra_tensors, model_tensors
from quantlab.export.gguf.vocabulary import vocabulary
from quantlab.nn.rotation import refusal, rotated_layers
from quantlab.utils.atomic import atomic_file, check_replaceable


@dataclass
class GGUFExport:
    """What `to_gguf` wrote: the file, its architecture and file type, and every tensor's type and origin."""

    path: Path
    bytes: int
    architecture: str
    file_type: str
    pre_tokenizer: str
    tensors: list[GGUFTensor] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def requantized(self) -> list[GGUFTensor]:
        """The matrices whose values in the file differ from the model's: rounded into their GGUF type."""
        return [tensor for tensor in self.tensors if tensor.requantized]

    @property
    def from_codes(self) -> list[GGUFTensor]:
        """The matrices written from quantlab's own codes and scales."""
        return [tensor for tensor in self.tensors if tensor.origin == "codes"]

    def type_counts(self) -> dict[str, int]:
        return dict(Counter(tensor.type for tensor in self.tensors))

    def to_json(self) -> dict[str, Any]:
        return {
            "output": str(self.path),
            "bytes": self.bytes,
            "architecture": self.architecture,
            "file_type": self.file_type,
            "pre_tokenizer": self.pre_tokenizer,
            "types": self.type_counts(),
            "requantized": [tensor.name for tensor in self.requantized],
            "tensors": [tensor.to_json() for tensor in self.tensors],
            "notes": self.notes,
        }


def to_gguf(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    tokenizer: Any,
    fallback_type: str | None = None,
    exact: bool = False,
    overwrite: bool = False,
    name: str | None = None,
) -> GGUFExport:
    """Write `model` and `tokenizer` to the GGUF file `path` (written beside it, then renamed into place).

    Quantized layers whose codes a GGUF type holds exactly keep them (`Codec.gguf_blocks`); other
    matrices are rounded into `fallback_type` (default: Q8_0 for the embedding table and output
    head, F16 for the others); norms and biases are F32. `exact=True` refuses to write any matrix
    whose values in the file would differ from the model's. `overwrite` replaces an existing file.
    """
    gguf = require_gguf()
    path = Path(path).expanduser()
    if path.is_dir():
        raise GGUFExportError(f"output {path} is a folder; name the .gguf file to write")
    check_replaceable(path, overwrite)
    architecture = architectures.architecture_of(model)
    rotated = rotated_layers(model)
    if rotated:
        raise GGUFExportError(refusal(rotated, "GGUF"))
    if tokenizer is None:
        raise GGUFExportError("a GGUF file carries its tokenizer: pass the model's tokenizer (none was found)")
    config = model.config
    vocab = vocabulary(tokenizer, config.vocab_size)
    tensors = model_tensors(model, architecture, fallback_type)
    if exact:
        _refuse_inexact(tensors)
    writer = _writer_class(gguf)(None, architecture.name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or Path(getattr(config, "_name_or_path", "") or path.stem).name or path.stem)
    tensors += extra_tensors(write_hyperparameters(writer, architecture, config))
    file_type = _file_type(tensors)
    writer.add_file_type(int(gguf.LlamaFileType[file_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.write(writer)
    for tensor in tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=gguf.GGMLQuantizationType[tensor.type])
    with atomic_file(path) as staging:
        writer.write_header_to_file(path=staging)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    notes = []
    if not vocab.pre_recognised:
        notes.append(f"the tokenizer's pre-tokenizer is not one llama.cpp's converter recognises; wrote {vocab.pre!r}")
    return GGUFExport(path, path.stat().st_size, architecture.name, file_type, vocab.pre, tensors, notes)


def _writer_class(gguf: Any) -> type:
    """gguf-py's writer, able to write an empty array whose element type is given.

    gguf-py refuses empty arrays, but llama.cpp needs `tokenizer.ggml.merges` in a "gpt2" vocabulary
    even when the tokenizer has no merges (a bare byte-level one), and transformers' reader derives
    merges from token scores (which such a file has none of) when the key is missing.
    """

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val: Any, vtype: Any, add_vtype: bool, sub_type: Any = None) -> bytes:
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                kind = self._pack("I", vtype) if add_vtype else b""
                return kind + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


def _refuse_inexact(tensors: list[GGUFTensor]) -> None:
    for tensor in tensors:
        if not tensor.exact:
            raise GGUFExportError(
                f"exact export refused: {tensor.name} ({tensor.module}) in {tensor.type} would differ from the model's "
                f"values ({tensor.reason}); quantize it into codes a GGUF type holds, or choose fallback type F32"
            )


def _file_type(tensors: list[GGUFTensor]) -> str:
    """`general.file_type`: the type holding most of the matrices' weights, as llama.cpp names it."""
    weights: Counter[str] = Counter()
    for tensor in tensors:
        if len(tensor.shape) >= 2:
            weights[tensor.type] += math.prod(tensor.shape)
    main = weights.most_common(1)[0][0] if weights else "F32"
    return "ALL_F32" if main == "F32" else f"MOSTLY_{main}"
