"""The fast decode path: transformers' `generate` with a static KV cache and a compiled decode step.

Eager decoding of a small model is mostly overhead: hundreds of module calls in Python per token,
and a dynamic cache that concatenates every layer's keys and values at every step. With
`cache_implementation="static"` the cache is allocated once (`max_cache_len` positions) and
written in place, so every decode step has the same shapes, and transformers hands the step to
`torch.compile` (its `compile_config`): one graph per step, quantlab's kernels inside it as torch
operators. transformers compiles only on accelerators unless told otherwise, and skips quantized
models whose quantizer does not declare itself compileable; `compile_for_decoding` sets both up
on any causal LM, float or quantized. The prompt (prefill) still runs eagerly, on the many-row
kernels; only the one-token steps run compiled. In the compiled step the quantized projections
that read one input (q/k/v, gate/up) run as one grouped call each (`fuse_projections`, fusion.py),
and grouped-query attention reads the cache's key/value heads in place (attention.py). A mixture of
experts' quantized projections (`QuantizedExperts`) route inside the operator `quantlab::routed_linear`
(quantlab.kernels.experts), so a mixture of experts decodes in one graph too.
"""

import copy
import itertools
from typing import Any

import torch
from torch._inductor.custom_graph_pass import get_custom_graph_passes
from transformers import CompileConfig, GenerationConfig

from quantlab.errors import ConfigError
from quantlab.generation.attention import stop_grouped_query_sdpa, use_grouped_query_sdpa
from quantlab.generation.counters import CompileCounts, count_compilations
from quantlab.generation.fusion import FuseProjections, mark_int8_activations
from quantlab.generation.kv_cache import QuantizedKVCache
from quantlab.generation.loop import NativeCachePreparation, NativeGenerate
from quantlab.generation.native import NativeDecodeStep, SkipMaskForNativeSteps

# Modes inductor runs on CPU; "reduce-overhead" and "max-autotune" add CUDA graphs (CUDA only).
CPU_COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
DEFAULT_MAX_CACHE_LEN = 1024


_step_numbers = itertools.count()


class _SkipModuleGuards(str):
    """torch.compile's `guard_filter_fn` that drops the guards on nn.Module attributes
    (`torch.compiler.skip_guard_on_all_nn_modules_unsafe`).

    A `str` that can be called: transformers hashes and saves a GenerationConfig through JSON, with
    its compile config inside, and a plain function there makes `save_pretrained` fail.
    """

    def __call__(self, guard_entries: list) -> list[bool]:
        return torch.compiler.skip_guard_on_all_nn_modules_unsafe(guard_entries)


SKIP_MODULE_GUARDS = _SkipModuleGuards("quantlab: skip_guard_on_all_nn_modules_unsafe")


def compile_for_decoding(
    model: Any,
    max_cache_len: int = DEFAULT_MAX_CACHE_LEN,
    mode: str = "default",
    fullgraph: bool = True,
    options: dict[str, Any] | None = None,
    module_guards: bool = False,
    fuse_projections: bool = True,
    int8_activations: bool = False,
    native_step: bool = False,
    kv_bits: int | None = None,
) -> Any:
    """Make `model.generate(...)` decode with a static cache and a torch.compile'd step; returns `model`.

    `max_cache_len` is the longest prompt plus new tokens decoded without recompiling (a longer call
    grows the cache and compiles once more); attention reads the whole static cache at every step,
    so keep it near what you generate. `mode` is a torch.compile mode that runs on CPU. `fullgraph`
    (default True: every quantized layer traces, on the torch operators, through ctypes, or on the
    reference kernel, and quantized experts as one routing operator) makes a graph break an error
    instead of a slowdown. The first generation compiles (tens of seconds): call `warm_up` to pay it
    up front. Generation options (sampling, stopping, streamers) work as in plain `generate`; a new
    batch size compiles once more.

    `module_guards=False` (the default) skips dynamo's checks of the model's modules before every
    step, a noticeable share of a small model's step (benchmarks/RESULTS.md). The compiled step then
    does not notice modules replaced or added after it was compiled, and runs the graph traced from
    the old ones on whatever tensors the new ones hold (values written into the existing tensors are
    fine): after wrapping the model (PEFT adapters, swapped layers) call `disable_compiled_decoding`
    and compile again, or pass `module_guards=True`.

    `fuse_projections=True` (the default) runs the quantized layers that read the same input with the
    same layout (a Llama block's q/k/v, and gate/up) as one `quantlab::linear_group` call each in the
    compiled step: one thread-team wake-up and one copy of x instead of three or two, the same output
    values (SmolLM2-135M: 211 quantized calls a token become 121). Nothing stored changes: the model
    keeps its modules, so saving, ONNX export and PEFT see the original layers, and the eager path
    (prefill, plain `generate`) stays unfused. `False` keeps one call per layer.

    `int8_activations=True` runs the step's 4-bit affine and int8 layers (groups of 64 or a multiple,
    or one group per row of such a length; the int8 output head of `embedding_bits=8` too) on
    activations rounded to int8 per block of 64 inputs, with integer dot products on CPUs with AVX2
    or AVX512-VNNI (llama.cpp's Q4_0 x Q8_0 and Q8_0 x Q8_0 schemes): faster at one row, not bit-exact
    (each layer's output carries a small relative error, benchmarks/RESULTS.md, so greedy tokens can
    differ from the eager path's); other formats, and CPUs without AVX2, compute in float as before. The
    model's eager forwards (the prompt's prefill, a teacher-forced evaluation) run those layers the same
    way, on many-row integer kernels, until `disable_compiled_decoding`. Off by default.

    `native_step=True` runs each one-token step of one sequence as a single call into quantlab's C
    library for the whole model (quantlab.generation.native: Llama and Qwen2 blocks whose projections
    are all in a native-kernel format, float32): no graph, no operator calls, the static cache written
    in place. Other steps (several sequences, padding) run the compiled step. Its values differ from the
    compiled step's in the last bits (attention and norms are summed in another order). It reads the
    weights described when it was set up (values written in place are seen): a model whose layers or
    stored tensors were replaced since is refused at the next generation, until set up again. For one
    sequence `model.generate` runs a lean loop of its own (quantlab.generation.loop). Off by default.
    With the native step, `generate` also takes a `past_key_values=QuantizedKVCache(...)` of a layout it
    reads (8 bits, `capacity` set) and decodes on it.

    `kv_bits=8` (with `native_step=True`) keeps every generation's KV cache in 8 bits: a
    `QuantizedKVCache(model.config, bits=8, capacity=max_cache_len)` (longer if the generation is), keys
    per channel and values per token, the last up to 128 tokens in float; the native step reads the codes
    as they are stored, a quarter of a float32 cache's bytes, which at long contexts is most of a step's
    reading (benchmarks/RESULTS.md). Steps the native step does not take run eagerly on that cache.
    """
    model.generation_config = fast_decoding_config(
        model,
        max_cache_len,
        mode,
        fullgraph,
        options,
        module_guards,
        fuse_projections,
        int8_activations,
        native_step,
        kv_bits,
    )
    return model


def fast_decoding_config(
    model: Any,
    max_cache_len: int = DEFAULT_MAX_CACHE_LEN,
    mode: str = "default",
    fullgraph: bool = True,
    options: dict[str, Any] | None = None,
    module_guards: bool = False,
    fuse_projections: bool = True,
    int8_activations: bool = False,
    native_step: bool = False,
    kv_bits: int | None = None,
) -> GenerationConfig:
    """A copy of `model.generation_config` set up as `compile_for_decoding` does, the model's own
    config untouched: `model.generate(ids, generation_config=config)` takes the fast path for that
    call only. The model keeps the compiled step made for this config; use one such config per model
    (with a second one, transformers compiles its own step, shared with other models of its class).
    With `native_step` the model also gets a `create_masks_for_generate` that skips the 4-D mask of the
    steps the native step takes (other steps get transformers' mask); `disable_compiled_decoding` removes it.
    On transformers' "sdpa" attention, the model's grouped-query attention layers are marked to run
    one-token steps without copying the cache for every query head (attention.py: the same attention);
    `disable_compiled_decoding` unmarks them."""
    _check_can_compile(model, max_cache_len, mode)
    _check_kv_bits(model, kv_bits, native_step)
    if not module_guards:
        options = {"guard_filter_fn": SKIP_MODULE_GUARDS, **(options or {})}
    if fuse_projections or int8_activations:
        options = _with_post_grad_pass(options, FuseProjections(fuse_projections, 8 if int8_activations else 0))
    compile_mode = mode
    if options:  # torch.compile takes a mode or options, not both: the mode's settings join the options
        options = {**torch._inductor.list_mode_options(mode), **options}
        compile_mode = None
    compile_config = CompileConfig(fullgraph=fullgraph, dynamic=False, mode=compile_mode, options=options)
    compile_config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    generation_config = copy.deepcopy(model.generation_config)
    generation_config.cache_implementation = "static"
    generation_config.max_cache_len = max_cache_len
    generation_config.compile_config = compile_config
    use_grouped_query_sdpa(model)
    mark_int8_activations(model, 8 if int8_activations else 0)
    _install_decode_step(model, compile_config)
    if native_step:
        model._compiled_call = NativeDecodeStep(model, model._compiled_call, 8 if int8_activations else 0)
        model.create_masks_for_generate = SkipMaskForNativeSteps(model)
        model.generate = NativeGenerate(model)
        model._prepare_cache_for_generation = NativeCachePreparation(model, kv_bits, max_cache_len)
    return generation_config


def _check_kv_bits(model: Any, kv_bits: int | None, native_step: bool) -> None:
    if kv_bits is None:
        return
    if kv_bits != 8 or not native_step:
        raise ConfigError(
            f"kv_bits={kv_bits!r}: a quantized KV cache runs on the native step at 8 bits "
            "(compile_for_decoding(model, kv_bits=8, native_step=True)); for 4 bits pass "
            "past_key_values=quantlab.QuantizedKVCache(model.config, bits=4) to plain generate"
        )
    QuantizedKVCache(model.config, bits=kv_bits)  # refuses models it cannot serve, in one line


def _with_post_grad_pass(options: dict[str, Any] | None, graph_pass: Any) -> dict[str, Any]:
    """`options` with `graph_pass` run first among inductor's post-grad custom passes (the caller's kept)."""
    options = dict(options or {})
    theirs = get_custom_graph_passes(options.get("post_grad_custom_post_pass"))
    options["post_grad_custom_post_pass"] = (graph_pass, *theirs) if theirs else graph_pass
    return options


def _install_decode_step(model: Any, compile_config: CompileConfig) -> None:
    """Hand transformers a compiled decode step whose code belongs to this model alone.

    transformers compiles `model.__call__`, whose code (`Module._wrapped_call_impl`) every module
    shares, and dynamo keeps its compiled graphs on the code: two models then share one list of
    graphs, told apart only by the guards on their modules. Without those guards (the default,
    see `compile_for_decoding`) a second model would run the first one's graph. A function of its
    own per model (a fresh code object) keeps each model's graphs apart; transformers reuses the
    step while the generation's compile config equals the one it was made for.
    """
    call = model.__call__

    def decode_step(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    decode_step.__code__ = decode_step.__code__.replace(co_name=f"decode_step_{next(_step_numbers)}")
    model._compiled_call = torch.compile(decode_step, **compile_config.to_dict())
    model._last_compile_config = compile_config


def disable_compiled_decoding(model: Any) -> Any:
    """Undo `compile_for_decoding`: dynamic cache, eager steps (the compiled step is dropped), attention unmarked."""
    generation_config = model.generation_config
    generation_config.cache_implementation = None
    generation_config.max_cache_len = None
    generation_config.compile_config = None
    names = ("_compiled_call", "_last_compile_config", "create_masks_for_generate", "generate")
    for name in (*names, "_prepare_cache_for_generation"):
        model.__dict__.pop(name, None)
    stop_grouped_query_sdpa(model)
    mark_int8_activations(model, 0)
    return model


def warm_up(model: Any, batch_size: int = 1, **generate_kwargs: Any) -> CompileCounts:
    """Compile the decode step for `batch_size` sequences now, by generating two tokens; returns what
    was compiled (one graph per batch size with no break, when everything traces)."""
    config = model.generation_config
    token = next((t for t in (config.bos_token_id, config.pad_token_id, 0) if isinstance(t, int)), 0)
    ids = torch.full((batch_size, 4), token, dtype=torch.long, device=model.device)
    kwargs = {"do_sample": False, "pad_token_id": token, **generate_kwargs}
    with count_compilations() as counts:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2, **kwargs)
    return counts


def _check_can_compile(model: Any, max_cache_len: int, mode: str) -> None:
    if not hasattr(model, "generate") or not hasattr(model, "generation_config"):
        raise ConfigError(f"{type(model).__name__} does not generate text: pass a causal language model")
    if not getattr(model, "_can_compile_fullgraph", False) or not model._supports_default_dynamic_cache():
        raise ConfigError(
            f"transformers does not support a static cache with torch.compile for {type(model).__name__}; "
            "decode it with plain model.generate(...)"
        )
    if not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool) or max_cache_len < 2:
        raise ConfigError(f"max_cache_len must be an integer >= 2 (prompt + new tokens), not {max_cache_len!r}")
    if mode not in CPU_COMPILE_MODES and model.device.type == "cpu":
        raise ConfigError(f"compile mode {mode!r} needs CUDA graphs; on CPU use one of {', '.join(CPU_COMPILE_MODES)}")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        method = getattr(quantizer.quantization_config, "quant_method", type(quantizer).__name__)
        raise ConfigError(f"this model's quantization ({method}) does not support torch.compile; use plain generate")
