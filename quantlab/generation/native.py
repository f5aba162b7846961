"""A native decode step for Llama-family models: one C call a token behind transformers' `generate`.

The compiled decode step (compiled.py) still runs a token as hundreds of small kernels and
operator calls driven by one Python graph; on a small model that costs as much as reading the
4-bit weights (see benchmarks/RESULTS.md). Here one call to `ql_decode_step` (csrc/decode.c)
runs every block of one token: norms, the quantized projections on the native kernels (q/k/v and
gate/up grouped), the rotary embedding, attention over transformers' own static cache (written in
place, its position count moved on), the MLP, the final norm, and the output head when it is
stored in a native format.
Python around it only looks the token up, asks the model's rotary module for cos/sin (so every
rope variant it implements works) and wraps the logits.

It is installed as the model's compiled step (`compile_for_decoding(..., native_step=True)`), so
`generate` keeps every option: sampling, logits processors, stopping criteria, streamers. Steps
it does not take (several sequences, padding, a dynamic cache, outputs of attentions or hidden
states) go to the compiled step, compiled the first time one comes.

What it takes (`NativeDecoder.check` says which part is missing, in one line): a causal LM whose
blocks are LlamaDecoderLayer-like (`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, RMS norms,
SiLU, full attention; q/k/v/o biases allowed, as Qwen2 has), float32, with every projection
quantized in a format of the native kernels (int8, NF4, IQ4_NL, 2-8 bit affine). Rotated inputs
(`rotate_inputs`) are rotated in C, each shared input once: q/k/v rotate together or not at all, as do gate/up.
"""

import copy
import ctypes
import weakref
from typing import Any

import torch
from transformers import StaticCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from quantlab.errors import ConfigError
from quantlab.generation.kv_cache import QuantizedKVCache
from quantlab.kernels.cpu import native
from quantlab.kernels.cpu.huge_pages import move_to_huge_pages
from quantlab.kernels.cpu.native import QuantlabCpuWeight
from quantlab.kernels.cpu.weights import NativeWeight, describable, native_weight
from quantlab.nn.rotation import core_signs as rotation_core_signs

_FLOATS = ctypes.POINTER(ctypes.c_float)
_PROJECTIONS = (
    ("q", "self_attn.q_proj"),
    ("k", "self_attn.k_proj"),
    ("v", "self_attn.v_proj"),
    ("o", "self_attn.o_proj"),
    ("gate", "mlp.gate_proj"),
    ("up", "mlp.up_proj"),
    ("down", "mlp.down_proj"),
)
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


# The projections that share one input, rotated once for all of them (`input_rotation` of each).
_ROTATED_INPUTS = (
    ("qkv_rotation", ("q", "k", "v")),
    ("o_rotation", ("o",)),
    ("gate_up_rotation", ("gate", "up")),
    ("down_rotation", ("down",)),
)


class NativeRotation(ctypes.Structure):
    """Mirror of `ql_rotation` in csrc/quantlab_cpu.h."""

    _fields_ = [("block", ctypes.c_int64), ("core", ctypes.c_int64), ("core_signs", ctypes.c_void_p)]


class NativeBlock(ctypes.Structure):
    """Mirror of `ql_block` in csrc/quantlab_cpu.h."""

    _fields_ = [
        ("attention_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        *((name, QuantlabCpuWeight) for name, _ in _PROJECTIONS),
        *((f"{name}_bias", ctypes.c_void_p) for name, _ in _PROJECTIONS),
        *((field, NativeRotation) for field, _ in _ROTATED_INPUTS),
    ]


class NativeDecoderStruct(ctypes.Structure):
    """Mirror of `ql_decoder`."""

    _fields_ = [
        ("blocks", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("norm_eps", ctypes.c_float),
        ("attention_scale", ctypes.c_float),
        ("block", ctypes.POINTER(NativeBlock)),
        ("final_norm", ctypes.c_void_p),
        ("head", ctypes.POINTER(QuantlabCpuWeight)),
        ("head_bias", ctypes.c_void_p),
    ]


class NativeCacheStruct(ctypes.Structure):
    """Mirror of `ql_cache`."""

    _fields_ = [
        ("keys", ctypes.POINTER(ctypes.c_void_p)),
        ("values", ctypes.POINTER(ctypes.c_void_p)),
        ("lengths", ctypes.POINTER(ctypes.c_void_p)),
        ("max_len", ctypes.c_int64),
    ]


_QUANTIZED_CACHE_TENSORS = ("key_codes", "value_codes", "key_scales", "key_zeros", "value_scales", "value_zeros")
_QUANTIZED_CACHE_TENSORS += ("window_keys", "window_values")


class NativeQuantizedCacheStruct(ctypes.Structure):
    """Mirror of `ql_quantized_cache`."""

    _fields_ = [
        *((name, ctypes.POINTER(ctypes.c_void_p)) for name in _QUANTIZED_CACHE_TENSORS),
        ("capacity", ctypes.c_int64),
        ("residual", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("stored", ctypes.c_int64),
        ("window", ctypes.c_int64),
    ]


def _bind(lib: ctypes.CDLL) -> Any:
    function = lib.ql_decode_step
    function.argtypes = [
        ctypes.POINTER(NativeDecoderStruct),
        ctypes.POINTER(NativeCacheStruct),
        ctypes.POINTER(NativeQuantizedCacheStruct),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
    ]
    function.restype = ctypes.c_int
    return function


def _float_tensor(tensor: torch.Tensor | None, what: str) -> torch.Tensor | None:
    if tensor is None:
        return None
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
        raise ConfigError(f"native_step needs a float32 model on the CPU; {what} is {tensor.dtype} on {tensor.device}")
    return tensor.detach().contiguous()


class NativeDecoder:
    """A model's blocks described once to `ql_decode_step`, with the tensors the description points at."""

    def __init__(self, model: Any, activation_bits: int = 0) -> None:
        self.lib = native.library()
        if self.lib is None:
            raise ConfigError(
                "native_step needs quantlab's native CPU kernels, which are unavailable here (no C compiler, or "
                "QUANTLAB_NATIVE_KERNELS=0); use compile_for_decoding without native_step"
            )
        self.step_function = _bind(self.lib)
        self.model = model
        self.activation_bits = activation_bits
        self.keep: list[Any] = []
        self.described: list[tuple[torch.nn.Module, dict[str, tuple[torch.Tensor, int]]]] = []
        self.edges: dict[tuple[int, str], tuple[torch.nn.Module, str, torch.nn.Module]] = {}
        self.struct = self._describe(model)
        self.cache_key: tuple = ()
        self.cache_ref: Any = lambda: None  # the cache `cache_struct` describes
        self.cache_struct = NativeCacheStruct()
        self.angle_key: tuple = ()
        self.angle_table = (torch.empty(0), torch.empty(0))  # rotary cos, sin by position (_angles)

    # ---- description -----------------------------------------------------------------------------------

    def _pointer(self, tensor: torch.Tensor | None, what: str) -> int | None:
        tensor = _float_tensor(tensor, what)
        if tensor is None:
            return None
        self.keep.append(tensor)
        return tensor.data_ptr()

    def _unchanged(self) -> bool:
        """True while the model holds the modules and tensors described (in-place writes are seen anyway).
        Dictionary lookups only, once a generation."""
        if any(parent._modules.get(name) is not child for parent, name, child in self.edges.values()):
            return False
        for module, tensors in self.described:
            for name, (tensor, pointer) in tensors.items():
                current = module._buffers.get(name)
                current = current if current is not None else module._parameters.get(name)
                if current is not tensor or current.data_ptr() != pointer:  # `param.data = ...` keeps the object
                    return False
        return True

    def _record(self, path: str, module: torch.nn.Module) -> None:
        """Remember `module` (at `path` of the model, through every module on the way) and its tensors."""
        parent = self.model
        for name in path.split("."):
            child = parent._modules[name]
            self.edges[(id(parent), name)] = (parent, name, child)
            parent = child
        tensors = module.stored_tensors() if hasattr(module, "stored_tensors") else {"weight": module.weight}
        self.described.append((module, {name: (t, t.data_ptr()) for name, t in tensors.items()}))

    def _weight(self, module: torch.nn.Module, name: str) -> NativeWeight:
        layout = getattr(module, "layout", None)
        if layout is None or not hasattr(module, "stored_tensors") or not describable(layout):
            kind = type(module).__name__
            if layout is not None:
                kind += f" ({layout.codec}, {layout.bits} bits)"
            raise ConfigError(
                f"native_step needs every projection in a native-kernel format (int8, NF4, IQ4_NL, 2-8 bit affine); "
                f"{name} is {kind}: quantize it, or use compile_for_decoding without native_step"
            )
        weight = native_weight(module)
        self.keep.append(weight)
        self._record(name, module)
        return weight

    def _rotation(self, prefix: str, projections: tuple[str, ...], blocks: list[int]) -> NativeRotation:
        """The rotation of the input `projections` share (`quantlab.nn.rotation`), applied once for all of them."""
        if len(set(blocks)) > 1:
            names = ", ".join(f"{prefix}.{dict(_PROJECTIONS)[p]}" for p in projections)
            raise ConfigError(
                f"native_step rotates the input {names} share once, and they rotate it differently "
                f"(rotate_inputs): rotate all of them or none, or use compile_for_decoding without native_step"
            )
        block = blocks[0]
        signs = rotation_core_signs(block) if block else None
        core = 1 if signs is None else signs.shape[0]
        return NativeRotation(block, core, self._pointer(signs, f"{prefix} rotation of order {block}"))

    def _describe(self, model: Any) -> NativeDecoderStruct:
        check_architecture(model)
        config = model.config
        body = model.model
        layers = list(body.layers)
        move_to_huge_pages(self._streamed(model, layers))
        first = layers[0].self_attn
        head_dim = int(getattr(first, "head_dim", 0) or config.hidden_size // config.num_attention_heads)
        blocks = (NativeBlock * len(layers))()
        for index, layer in enumerate(layers):
            block = blocks[index]
            prefix = f"model.layers.{index}"
            block.attention_norm = self._pointer(layer.input_layernorm.weight, f"{prefix}.input_layernorm")
            block.mlp_norm = self._pointer(layer.post_attention_layernorm.weight, f"{prefix}.post_attention_layernorm")
            self._record(f"{prefix}.input_layernorm", layer.input_layernorm)
            self._record(f"{prefix}.post_attention_layernorm", layer.post_attention_layernorm)
            rotations = {}
            for field, path in _PROJECTIONS:
                name = f"{prefix}.{path}"
                module = layer.get_submodule(path)
                setattr(block, field, self._weight(module, name).struct)
                setattr(block, f"{field}_bias", self._pointer(module.bias, f"{name}.bias"))
                rotations[field] = getattr(module, "input_rotation", 0)
            for field, projections in _ROTATED_INPUTS:
                setattr(block, field, self._rotation(prefix, projections, [rotations[p] for p in projections]))
        self.keep.append(blocks)
        struct = NativeDecoderStruct(
            blocks=len(layers),
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            intermediate=layers[0].mlp.gate_proj.out_features,
            norm_eps=float(layers[0].input_layernorm.variance_epsilon),
            attention_scale=float(first.scaling),
            block=blocks,
            final_norm=self._pointer(body.norm.weight, "model.norm"),
        )
        self._record("model.norm", body.norm)
        self.embedding = self._native_table(model.get_input_embeddings())
        head = self._native_table(model.get_output_embeddings())
        if head is not None:
            struct.head = ctypes.pointer(head.struct)
            struct.head_bias = self._pointer(getattr(model.lm_head, "bias", None), "lm_head.bias")
        return struct

    @staticmethod
    def _streamed(model: Any, layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """The modules whose stored tensors every token reads: projections and tables in native formats."""
        projections = [layer.get_submodule(path) for layer in layers for _, path in _PROJECTIONS]
        tables = [getattr(m, "embedding", m) for m in (model.get_input_embeddings(), model.get_output_embeddings())]
        found = [m for m in [*projections, *tables] if m is not None and hasattr(m, "stored_tensors")]
        return [m for m in found if getattr(m, "layout", None) is not None and describable(m.layout)]

    def _native_table(self, module: torch.nn.Module | None) -> NativeWeight | None:
        """The description of an embedding table or output head stored in a native format, else None."""
        table = getattr(module, "embedding", module)  # a tied quantized head reads the embedding's table
        layout = getattr(table, "layout", None)
        if layout is None or not hasattr(table, "stored_tensors") or not describable(layout):
            return None
        weight = native_weight(table)
        self.keep.append(weight)
        path = next(name for name, candidate in self.model.named_modules() if candidate is table)
        self._record(path, table)
        return weight

    # ---- one step ---------------------------------------------------------------------------------------

    def _check_unchanged(self) -> None:
        if not self._unchanged():
            raise ConfigError(
                "the model's layers or stored tensors were replaced after native_step was set up; call "
                "compile_for_decoding(..., native_step=True) again"
            )

    def _cache(self, cache: StaticCache) -> NativeCacheStruct:
        """The cache's tensors as `ql_cache` (rebuilt when generate made a new cache)."""
        layers = cache.layers
        key = (layers[0].keys.data_ptr(), layers[-1].values.data_ptr())
        if self.cache_ref() is not cache or key != self.cache_key:  # a new generation: is the model unchanged?
            self._check_unchanged()
            count = len(layers)
            keys = (ctypes.c_void_p * count)(*(layer.keys.data_ptr() for layer in layers))
            values = (ctypes.c_void_p * count)(*(layer.values.data_ptr() for layer in layers))
            lengths = (ctypes.c_void_p * count)(*(layer.cumulative_length.data_ptr() for layer in layers))
            self.cache_struct = NativeCacheStruct(keys, values, lengths, layers[0].max_cache_len)
            self.cache_arrays = (keys, values, lengths)  # the struct points into them
            self.cache_ref = weakref.ref(cache)  # not kept alive: a finished generation's cache is freed
            self.cache_key = key
        return self.cache_struct

    def _quantized_cache(self, cache: QuantizedKVCache) -> NativeQuantizedCacheStruct:
        """The quantized cache's tensors as `ql_quantized_cache` (rebuilt when a tensor was allocated anew or
        generate made a new cache), with this step's counts."""
        if not self.reads_quantized_cache(cache):
            raise ConfigError(
                "native_step reads a QuantizedKVCache of 8 bits, keys not rotated, allocated with a capacity, "
                "holding one float32 sequence; generate with another cache, or without native_step"
            )
        layers = cache.layers
        key = tuple(layer.version for layer in layers)
        if self.cache_ref() is not cache or key != self.cache_key:
            self._check_unchanged()
            held = [layer.allocated_tensors() for layer in layers]
            arrays = {
                name: (ctypes.c_void_p * len(layers))(*(tensors[name].data_ptr() for tensors in held))
                for name in _QUANTIZED_CACHE_TENSORS
            }
            first = layers[0]
            self.cache_struct = NativeQuantizedCacheStruct(
                **arrays,
                capacity=first.buffers["key_codes"].shape[-2],
                residual=first.residual_length,
                group=first.value_group,
            )
            self.cache_arrays = arrays  # the struct points into them
            self.cache_ref = weakref.ref(cache)
            self.cache_key = key
        self.cache_struct.stored = layers[0].stored_length
        self.cache_struct.window = layers[0].window_length
        return self.cache_struct

    def takes(self, input_ids: Any, cache: Any, attention_mask: Any, kwargs: dict) -> bool:
        """True when the step is one token of one unpadded sequence on an initialized static cache, or on a
        quantized cache the step reads (`reads_quantized_cache`)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.shape != (1, 1):
            return False
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            return False
        if kwargs.get("inputs_embeds") is not None:
            return False
        if isinstance(cache, QuantizedKVCache):
            return self.reads_quantized_cache(cache) and _causal_without_padding(attention_mask, cache.get_seq_length())
        if not isinstance(cache, StaticCache):
            return False
        layers = cache.layers
        if len(layers) != self.struct.blocks or not all(getattr(layer, "is_initialized", False) for layer in layers):
            return False
        first = layers[0]
        if first.keys.dtype != torch.float32 or first.keys.shape[0] != 1 or getattr(first, "is_sliding", False):
            return False
        return _causal_without_padding(attention_mask, int(first.cumulative_length))

    def can_read_quantized_cache(self, cache: Any) -> bool:
        """True for a QuantizedKVCache of a layout the step reads and writes in place: 8 bits, keys not
        rotated, allocated up front (`capacity`), a layer per block."""
        return (
            isinstance(cache, QuantizedKVCache)
            and cache.bits == 8
            and not cache.rotate_keys
            and cache.capacity is not None
            and len(cache.layers) == self.struct.blocks
        )

    def reads_quantized_cache(self, cache: Any) -> bool:
        """True when the step reads `cache` now: a layout it reads (`can_read_quantized_cache`), initialized,
        one float32 sequence, every layer at the same length."""
        if not self.can_read_quantized_cache(cache) or not all(layer.is_initialized for layer in cache.layers):
            return False
        layers = cache.layers
        first = layers[0]
        window = first.allocated_tensors()["window_keys"]
        if window.dtype != torch.float32 or window.shape[0] != 1 or window.device.type != "cpu":
            return False
        return all(
            (layer.stored_length, layer.window_length) == (first.stored_length, first.window_length) for layer in layers
        )

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token's row `[1, 1, hidden]`: decoded by one native call from a quantized table (the values
        the table's own lookup gives), else looked up by the embedding module."""
        token = int(input_ids)
        if self.embedding is None or not 0 <= token < self.embedding.out_features:
            return self.model.model.embed_tokens(input_ids).float().contiguous()
        width = self.embedding.in_features
        hidden = torch.empty(1, 1, width)
        status = self.lib.ql_dequantize(self.embedding.pointer, token, token + 1, hidden.data_ptr(), width, 1)
        if status:
            raise RuntimeError(f"quantlab's native embedding lookup failed with status {status} (a quantlab bug)")
        return hidden

    def greedy_tokens(self, scores: torch.Tensor) -> torch.Tensor:
        """`torch.argmax(scores, dim=-1)` (the same index, NaN included) of one row of float32 scores, in one native
        call: torch's argmax over a vocabulary costs a tenth of the Python around a step."""
        if scores.dim() != 2 or scores.shape[0] != 1 or scores.dtype != torch.float32 or not scores.is_contiguous():
            return torch.argmax(scores, dim=-1)
        return torch.tensor([self.lib.ql_argmax(scores.data_ptr(), scores.shape[1])])

    def _angles(
        self, hidden: torch.Tensor, position: int, position_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos/sin `[head_dim]` of the token: the model's rotary module computes them, for a static
        rope (its angles depend on the position alone) once for a table of positions, which the following tokens
        read (the same values: each angle is one product, whatever the positions beside it)."""
        rotary = self.model.model.rotary_emb
        rope_type = str(getattr(rotary, "rope_type", "default"))
        if position_ids is not None or "dynamic" in rope_type or "longrope" in rope_type:
            ids = position_ids if position_ids is not None else torch.tensor([[position]])
            cos, sin = rotary(hidden, ids)
            return cos.float().contiguous(), sin.float().contiguous()
        frequencies = rotary.inv_freq
        key = (id(rotary), frequencies.data_ptr(), frequencies._version)
        if self.angle_key != key or position >= self.angle_table[0].shape[0]:
            cos, sin = rotary(hidden, torch.arange(max(256, 2 * position + 1))[None])
            self.angle_table = (cos[0].float().contiguous(), sin[0].float().contiguous())
            self.angle_key = key
        return self.angle_table[0][position], self.angle_table[1][position]

    def step(self, input_ids: torch.Tensor, cache: Any, position_ids: torch.Tensor | None) -> torch.Tensor:
        """Logits `[1, 1, vocab]` of the token, its keys and values written to `cache` (a static cache, or a
        quantized cache the step reads)."""
        quantized = isinstance(cache, QuantizedKVCache)
        if quantized:
            position = cache.get_seq_length()
            cache_struct, quantized_struct = None, self._quantized_cache(cache)
        else:
            position = int(cache.layers[0].cumulative_length)
            cache_struct, quantized_struct = self._cache(cache), None
            if position >= cache_struct.max_len:
                raise ConfigError(
                    f"the static cache holds {cache_struct.max_len} positions and is full; pass a larger max_cache_len"
                )
        hidden = self._embed(input_ids)
        cos, sin = self._angles(hidden, position, position_ids)
        head = self.struct.head
        logits = torch.empty(1, 1, head.contents.n if head else 0)
        status = self.step_function(
            ctypes.byref(self.struct),
            None if quantized else ctypes.byref(cache_struct),
            ctypes.byref(quantized_struct) if quantized else None,
            hidden.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            position,
            logits.data_ptr(),
            torch.get_num_threads(),
            self.activation_bits,
        )
        if status:
            raise RuntimeError(f"quantlab's native decode step failed with status {status} (a quantlab bug)")
        if quantized:
            for layer in cache.layers:
                layer.window_token_written()
        if not head:
            logits = self.model.lm_head(hidden)
        return logits


def _causal_without_padding(mask: torch.Tensor | None, position: int) -> bool:
    """True when `mask` lets the token at `position` see exactly positions 0..position: a 2-D mask of
    ones, or the 4-D static-cache mask generate builds (bool, or float with 0 where allowed)."""
    if isinstance(mask, dict):  # one mask per attention type (Qwen2): only full attention is run here
        if set(mask) != {"full_attention"}:
            return False
        mask = mask["full_attention"]
    if mask is None:
        return True
    if mask.dim() == 2:
        return mask.shape[0] == 1 and bool(mask.all())
    if mask.dim() != 4 or mask.shape[:3] != (1, 1, 1) or mask.shape[3] <= position:
        return False
    row = mask[0, 0, 0]
    allowed = row if row.dtype == torch.bool else row == 0
    return bool(allowed[: position + 1].all()) and not bool(allowed[position + 1 :].any())


def check_architecture(model: Any) -> None:
    """Raise a one-line ConfigError unless `model` has the block structure `ql_decode_step` runs."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"native_step runs {', '.join(SUPPORTED_MODEL_TYPES)} models, not {model_type or type(model).__name__}; "
            "use compile_for_decoding without native_step"
        )
    layer_types = getattr(config, "layer_types", None) or ()
    sliding = getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types)
    if sliding:
        raise ConfigError("native_step runs full attention only; this model has sliding-window layers")
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        raise ConfigError(
            f"native_step needs SiLU MLPs (hidden_act='silu', pretraining_tp=1); this model has "
            f"hidden_act={config.hidden_act!r}"
        )
    if getattr(config, "mlp_bias", False):
        raise ConfigError("native_step does not run MLP biases (mlp_bias=True)")


class SkipMaskForNativeSteps:
    """The model's `create_masks_for_generate` (the hook transformers' `prepare_inputs_for_generation`
    looks up on the model) that builds no mask for the steps the native step takes.

    With a static cache, generate turns the 2-D attention mask into a 4-D causal mask over the whole
    cache before every step, a noticeable part of a native step. For one unpadded sequence
    that mask says nothing the native step does not assume, so it gets None; every other step (the
    prompt, several sequences, padding) gets the mask transformers would build."""

    def __init__(self, model: Any) -> None:
        from transformers.masking_utils import create_masks_for_generate

        own = getattr(type(model), "create_masks_for_generate", None)  # a model class may define its own
        self.build = own.__get__(model) if own is not None else create_masks_for_generate

    def __call__(self, config: Any, inputs_embeds: torch.Tensor, attention_mask: Any, past_key_values: Any, **kwargs):
        one_token = tuple(inputs_embeds.shape[:2]) == (1, 1) and isinstance(past_key_values, StaticCache)
        if one_token and (attention_mask is None or (attention_mask.dim() == 2 and bool(attention_mask.all()))):
            return None
        return self.build(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                          past_key_values=past_key_values, **kwargs)  # fmt: skip


class NativeDecodeStep:
    """The decode step transformers' `generate` calls: the native step where it applies, else `fallback`."""

    def __init__(self, model: Any, fallback: Any, activation_bits: int = 0) -> None:
        self.model = model
        self.fallback = fallback
        self.activation_bits = activation_bits
        self._decoder: NativeDecoder | None = NativeDecoder(model, activation_bits)  # refusals raise at set-up
        self.native_steps = 0
        self.fallback_steps = 0
        self.lean_loops = 0  # generate calls run by loop.native_sample

    @property
    def decoder(self) -> NativeDecoder:
        if self._decoder is None:  # a copy describes its own model's tensors on first use
            self._decoder = NativeDecoder(self.model, self.activation_bits)
        return self._decoder

    def __deepcopy__(self, memo: dict) -> "NativeDecodeStep":
        """A copied model gets a step of its own; its description is built when it first decodes (the
        C structures point into the original's tensors and cannot be copied)."""
        copied = NativeDecodeStep.__new__(NativeDecodeStep)
        memo[id(self)] = copied
        copied.model = copy.deepcopy(self.model, memo)
        copied.fallback = copy.deepcopy(self.fallback, memo)
        copied.activation_bits = self.activation_bits
        copied._decoder = None
        copied.native_steps = copied.fallback_steps = copied.lean_loops = 0
        return copied

    def __call__(
        self,
        input_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if not self.decoder.takes(input_ids, past_key_values, attention_mask, kwargs):
            self.fallback_steps += 1
            return self.fallback(
                input_ids=input_ids,
                past_key_values=past_key_values,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **kwargs,
            )
        self.native_steps += 1
        with torch.no_grad():
            logits = self.decoder.step(input_ids, past_key_values, position_ids)
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)
