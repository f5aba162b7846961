"""llama.cpp through llama-cpp-python, the peer CPU users pick: quantized from the same weights, timed
like quantlab's models.

The GGUF file SmolLM2 ships as (Q4_1, the source of quantlab's fp32 checkpoint) is requantized
with llama.cpp's own quantize API (`allow_requantize`: llama.cpp decodes it to float first, so
every type is made from the same weights quantlab quantizes). The files are written once into
`$QUANTLAB_CACHE/llama-cpp`. llama-cpp-python is optional (`pip install 'quantlab[peers]'`; it
compiles llama.cpp for several minutes): without it the peers are skipped with a note.

A native build of llama.cpp can crash on some CPUs: on an Intel Xeon with AMX, llama-cpp-python 0.3.36
built with `AMX_INT8` died with a segmentation fault at the first decode of a Q4_0 or Q8_0 file. So each
file is first decoded in a child process (`open_model`): with llama.cpp's extra buffer types (its repacked
and AMX kernels, the default), else without them; a setting that crashes is named in a note, and a file
no setting runs is skipped.
"""

import contextlib
import ctypes
import functools
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from quantlab.assets.models import cache_dir, smollm2_gguf
from quantlab.utils.atomic import atomic_file

PEER_TYPES = ("Q8_0", "Q4_0", "Q4_K_M")


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def quantized_file(quant_type: str, threads: int) -> Path:
    """SmolLM2 in `quant_type` (a llama.cpp type name such as Q4_K_M), made once from the shipped GGUF."""
    import llama_cpp

    target = cache_dir() / "llama-cpp" / f"SmolLM2-135M-Instruct.{quant_type}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant_type}")
    params.nthread = threads
    params.allow_requantize = True
    with atomic_file(target) as staging:
        status = llama_cpp.llama_model_quantize(
            str(smollm2_gguf()).encode(), str(staging).encode(), ctypes.byref(params)
        )
        if status != 0:
            raise RuntimeError(f"llama.cpp could not quantize SmolLM2 to {quant_type} (status {status})")
    return target


@contextlib.contextmanager
def _model_parameters(extra_buffers: bool) -> Iterator[None]:
    """Models loaded inside use llama.cpp's extra buffer types or not (llama-cpp-python has no argument for it)."""
    import llama_cpp.llama_cpp as bindings

    default = bindings.llama_model_default_params

    def parameters():
        chosen = default()
        chosen.use_extra_bufts = extra_buffers
        return chosen

    bindings.llama_model_default_params = parameters
    try:
        yield
    finally:
        bindings.llama_model_default_params = default


class LlamaCppModel:
    """One llama.cpp model: greedy generation from token ids and prompt processing, timed."""

    def __init__(self, path: Path, threads: int, context: int, extra_buffers: bool = True) -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.extra_buffers = extra_buffers
        with _model_parameters(extra_buffers):
            self.llm = llama_cpp.Llama(
                model_path=str(path), n_ctx=context, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False,
            )  # fmt: skip

    def _next_token(self) -> int:
        logits = self._llama_cpp.llama_get_logits(self.llm.ctx)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))))

    def generate(self, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        """Seconds to process `prompt` and choose `tokens` greedy tokens, and the tokens."""
        start = time.perf_counter()
        self.llm.reset()
        self.llm.eval(prompt)
        generated = [self._next_token()]
        while len(generated) < tokens:
            self.llm.eval([generated[-1]])
            generated.append(self._next_token())
        return time.perf_counter() - start, generated

    def decode_seconds(self, prompt: list[int], tokens: int) -> float:
        """Seconds of the greedy loop after `prompt`: `tokens - 1` steps of one token each, as users run it."""
        self.llm.reset()
        self.llm.eval(prompt)
        token = self._next_token()
        start = time.perf_counter()
        for _ in range(tokens - 1):
            self.llm.eval([token])
            token = self._next_token()
        return time.perf_counter() - start

    def close(self) -> None:
        self.llm.close()

    def prefill_seconds(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self.llm.reset()
        self.llm.eval(prompt)
        return time.perf_counter() - start


@functools.cache
def _failure(path: Path, threads: int, extra_buffers: bool) -> str | None:
    """None when a child process decodes a prompt and a few tokens of `path` with this setting, else how it died."""
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import _llama_cpp; "
        "model = _llama_cpp.LlamaCppModel(Path(sys.argv[2]), int(sys.argv[3]), 64, sys.argv[4] == '1'); "
        "model.generate(list(range(100, 116)), 4)"
    )
    here = str(Path(__file__).parent)
    arguments = [sys.executable, "-c", code, here, str(path), str(threads), "1" if extra_buffers else "0"]
    try:
        child = subprocess.run(arguments, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "no answer in 10 minutes"
    if child.returncode == 0:
        return None
    if child.returncode < 0:
        return f"killed by {signal.Signals(-child.returncode).name}"
    last = (child.stderr.strip().splitlines() or ["no message"])[-1]
    return f"exit status {child.returncode}: {last}"


def open_model(path: Path, threads: int, context: int) -> LlamaCppModel | None:
    """llama.cpp on `path` with the first setting that runs on this machine (extra buffer types on, else off),
    each crash said in a note; None, also with a note, when neither runs."""
    for extra_buffers in (True, False):
        failure = _failure(path, threads, extra_buffers)
        setting = "with" if extra_buffers else "without"
        if failure is None:
            if not extra_buffers:
                print(f"  note: llama.cpp runs {path.name} {setting} its extra buffer types (repacked and AMX kernels)")
            return LlamaCppModel(path, threads, context, extra_buffers)
        print(f"  note: llama.cpp did not decode {path.name} {setting} its extra buffer types here ({failure})")
    print(f"  note: {path.name} skipped: no llama.cpp setting runs it on this machine")
    return None
