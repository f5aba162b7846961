"""llama.cpp through llama-cpp-python, the peer CPU users pick: quantized from the same weights, timed
like quantlab's models.

The GGUF file SmolLM2 ships as (Q4_1, the source of quantlab's fp32 checkpoint) is requantized
with llama.cpp's own quantize API (`allow_requantize`: llama.cpp decodes it to float first, so
every type is made from the same weights quantlab quantizes). The files are written once into
`$QUANTLAB_CACHE/llama-cpp`. llama-cpp-python is optional (`pip install 'quantlab[peers]'`; it
compiles llama.cpp for several minutes): without it the peers are skipped with a note.
"""

import ctypes
import time
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


class LlamaCppModel:
    """One llama.cpp model: greedy generation from token ids and prompt processing, timed."""

    def __init__(self, path: Path, threads: int, context: int) -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=context, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
        )

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
