"""A quantized KV cache for `model.generate` and chunked prefill (KIVI-style, quantized once).

Layouts, per layer (B batch, H key/value heads, D head_dim, R `residual_length`):

- keys are quantized per channel: every chunk of R tokens has one scale and one zero per head-dim
  channel (`key_scales`, `key_zeros`: `[B, H, chunks, D]`), which follows the few key channels
  with large magnitudes; optionally the keys are first rotated by a normalized Hadamard matrix,
  which spreads those channels over all of them (stored keys are rotated, returned ones are not);
- values are quantized per token, in groups of `group_size` along head_dim (`value_scales`,
  `value_zeros`: `[B, H, tokens, D / group_size]`);
- codes are asymmetric unsigned integers of `bits` (8, or 4 packed two a byte along head_dim):
  `x ~= code * scale + zero`, scales and zeros in float16 (float32 for bfloat16 models, whose
  range float16 does not cover);
- the most recent `< R` tokens stay in float, in the model's dtype (`keys`, `values`).

When the float window reaches R tokens, those whole chunks are quantized once and appended; what
is stored is never quantized again, so the error does not compound and the cost of a flush does
not grow with the history (transformers' `QuantizedLayer` re-quantizes the whole history at every
flush). `update` returns the stored chunks dequantized, then the float window and the new states,
which the attention reads as a float cache: the tokens of one `update` see each other in float.

With `capacity`, every tensor is allocated once and written in place, and at 8 bits (keys not rotated)
the native decode step (quantlab.generation.native, csrc/kv_attention.c) reads the codes as they are
stored, without dequantizing them into memory: a quarter of a float32 cache's bytes per step.
"""

import math

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from quantlab.errors import ConfigError, QuantlabError
from quantlab.nn.rotation import hadamard

BITS = (4, 8)


class KVCacheModelError(QuantlabError, ValueError):
    """A model whose config a quantized KV cache cannot serve (not a decoder, or attention shapes unknown)."""


STORED_TENSORS = ("key_codes", "key_scales", "key_zeros", "value_codes", "value_scales", "value_zeros")
_PER_CHUNK = ("key_scales", "key_zeros")  # one row per chunk of R tokens; the others have one per token


class QuantizedKVLayer(CacheLayerMixin):
    """One attention layer's cache: quantized chunks of keys and values, then a float residual window.

    Without `capacity` the stored tensors grow by what each flush adds and the window holds only its
    tokens (the bytes held are the bytes used). With `capacity` (tokens, rounded up to whole chunks)
    they are allocated once on the first update, the window too (R tokens), so a decode step writes
    into them in place and the native step (quantlab.generation.native) can read them; past
    `capacity` they double. `version` counts the times a tensor was allocated anew.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False  # a crop into the stored chunks cannot give back the float states

    def __init__(
        self,
        bits: int = 8,
        residual_length: int = 128,
        group_size: int = 64,
        rotate_keys: bool = False,
        capacity: int | None = None,
    ):
        super().__init__()
        self.bits = bits
        self.residual_length = residual_length
        self.group_size = group_size
        self.rotate_keys = rotate_keys
        self.capacity = None if capacity is None else -(-capacity // residual_length) * residual_length
        self.cumulative_length = 0
        self.version = 0
        self.rotation: torch.Tensor | None = None
        self._clear_stored()
        self._window_keys = self._window_values = None
        self.window_length = 0

    def _clear_stored(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}  # codes and statistics, `stored_length` tokens of them used
        self.stored_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        head_dim = key_states.shape[-1]
        self.stat_dtype = torch.float32 if self.dtype == torch.bfloat16 else torch.float16
        self.value_group = self.group_size if head_dim % self.group_size == 0 else head_dim
        if self.rotate_keys:
            self.rotation = hadamard(head_dim, device=self.device)
        if self.capacity is not None:
            self._allocate(*key_states.shape[:2], head_dim)
        self._set_window(key_states[..., :0, :], value_states[..., :0, :])
        self.is_initialized = True

    def _allocate(self, batch: int, heads: int, head_dim: int) -> None:
        """Allocate `capacity` tokens of storage and the R-token window (capacity mode)."""
        packed = head_dim if self.bits == 8 else head_dim // 2
        chunks = self.capacity // self.residual_length
        shapes = {
            "key_codes": ((self.capacity, packed), torch.uint8),
            "key_scales": ((chunks, head_dim), self.stat_dtype),
            "key_zeros": ((chunks, head_dim), self.stat_dtype),
            "value_codes": ((self.capacity, packed), torch.uint8),
            "value_scales": ((self.capacity, head_dim // self.value_group), self.stat_dtype),
            "value_zeros": ((self.capacity, head_dim // self.value_group), self.stat_dtype),
        }
        self.buffers = {
            name: torch.empty(batch, heads, *shape, dtype=dtype, device=self.device)
            for name, (shape, dtype) in shapes.items()
        }
        window = (batch, heads, self.residual_length, head_dim)
        self._window_keys = torch.empty(window, dtype=self.dtype, device=self.device)
        self._window_values = torch.empty(window, dtype=self.dtype, device=self.device)
        self.version += 1

    def allocated_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held, whole: the stored codes and statistics, then `window_keys`/`window_values` (R
        tokens in capacity mode). The native decode step points at them."""
        return {**self.buffers, "window_keys": self._window_keys, "window_values": self._window_values}

    # ---- the float window ------------------------------------------------------------------------------

    @property
    def keys(self) -> torch.Tensor | None:
        """The float window's keys, `[B, H, window_length, D]`."""
        return None if self._window_keys is None else self._window_keys[..., : self.window_length, :]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:  # CacheLayerMixin sets None
        self._window_keys, self.window_length = value, 0 if value is None else value.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        """The float window's values, `[B, H, window_length, D]`."""
        return None if self._window_values is None else self._window_values[..., : self.window_length, :]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._window_values = value

    def _set_window(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make `keys`/`values` (fewer than R tokens) the window: copied into its buffer, or held as they are."""
        if self.capacity is None:
            self._window_keys, self._window_values = keys.clone(), values.clone()
        else:
            self._window_keys[..., : keys.shape[-2], :] = keys
            self._window_values[..., : values.shape[-2], :] = values
        self.window_length = keys.shape[-2]

    # ---- what is stored ---------------------------------------------------------------------------------

    def _rows(self, name: str, tokens: int) -> int:
        return tokens // self.residual_length if name in _PER_CHUNK else tokens

    def _view(self, name: str) -> torch.Tensor | None:
        buffer = self.buffers.get(name)
        return None if buffer is None else buffer[..., : self._rows(name, self.stored_length), :]

    key_codes = property(lambda self: self._view("key_codes"), doc="`[B, H, stored, D or D/2]` uint8")
    key_scales = property(lambda self: self._view("key_scales"), doc="`[B, H, stored / R, D]`")
    key_zeros = property(lambda self: self._view("key_zeros"), doc="`[B, H, stored / R, D]`")
    value_codes = property(lambda self: self._view("value_codes"), doc="`[B, H, stored, D or D/2]` uint8")
    value_scales = property(lambda self: self._view("value_scales"), doc="`[B, H, stored, D / group]`")
    value_zeros = property(lambda self: self._view("value_zeros"), doc="`[B, H, stored, D / group]`")

    def _append_stored(self, new: dict[str, torch.Tensor], tokens: int) -> None:
        """Write the quantized tensors of `tokens` more tokens after what is stored."""
        end = self.stored_length + tokens
        for name, tensor in new.items():
            start, rows = self._rows(name, self.stored_length), self._rows(name, end)
            buffer = self.buffers.get(name)
            if buffer is None or buffer.shape[-2] < rows:
                size = rows
                if self.capacity is not None:
                    size = max(rows, self._rows(name, self.capacity), 2 * (0 if buffer is None else buffer.shape[-2]))
                grown = tensor.new_empty((*tensor.shape[:-2], size, tensor.shape[-1]))
                if start:
                    grown[..., :start, :] = buffer[..., :start, :]
                self.buffers[name] = buffer = grown
                self.version += 1
            buffer[..., start:rows, :] = tensor
        self.stored_length = end

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new states; return all keys and values (stored chunks dequantized, then the float ones)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pending_keys = torch.cat([self.keys, key_states], dim=-2)
        pending_values = torch.cat([self.values, value_states], dim=-2)
        if self.stored_length:
            all_keys = torch.cat([self.dequantized_keys(), pending_keys], dim=-2)
            all_values = torch.cat([self.dequantized_values(), pending_values], dim=-2)
        else:
            all_keys, all_values = pending_keys, pending_values
        full = pending_keys.shape[-2] // self.residual_length * self.residual_length
        if full:
            self._store(pending_keys[..., :full, :], pending_values[..., :full, :])
        self._set_window(pending_keys[..., full:, :], pending_values[..., full:, :])
        self.cumulative_length += key_states.shape[-2]
        return all_keys, all_values

    def window_token_written(self) -> None:
        """Count the token a native decode step wrote at slot `window_length` of the window (capacity mode);
        a full window is quantized into the stored chunks."""
        self.window_length += 1
        self.cumulative_length += 1
        if self.window_length == self.residual_length:
            self._store(self._window_keys, self._window_values)
            self.window_length = 0

    def _store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize whole chunks of R tokens and append them to what is stored."""
        batch, heads, length, head_dim = keys.shape
        keys = keys.float()
        if self.rotation is not None:
            keys = keys @ self.rotation
        chunks = keys.reshape(batch, heads, length // self.residual_length, self.residual_length, head_dim)
        key_codes, key_scales, key_zeros = quantize(chunks, dim=-2, bits=self.bits, stat_dtype=self.stat_dtype)
        groups = values.float().reshape(batch, heads, length, head_dim // self.value_group, self.value_group)
        value_codes, value_scales, value_zeros = quantize(groups, dim=-1, bits=self.bits, stat_dtype=self.stat_dtype)
        new = {
            "key_codes": pack(key_codes.reshape(batch, heads, length, head_dim), self.bits),
            "key_scales": key_scales.squeeze(-2),
            "key_zeros": key_zeros.squeeze(-2),
            "value_codes": pack(value_codes.reshape(batch, heads, length, head_dim), self.bits),
            "value_scales": value_scales.squeeze(-1),
            "value_zeros": value_zeros.squeeze(-1),
        }
        self._append_stored(new, length)

    def dequantized_keys(self) -> torch.Tensor:
        """The stored keys in the model's dtype, unrotated: `[B, H, stored_length, D]`."""
        codes = unpack(self.key_codes, self.bits).float()
        batch, heads, length, head_dim = codes.shape
        chunks = codes.view(batch, heads, -1, self.residual_length, head_dim)
        keys = chunks * self.key_scales.float().unsqueeze(-2) + self.key_zeros.float().unsqueeze(-2)
        keys = keys.view(batch, heads, length, head_dim)
        if self.rotation is not None:
            keys = keys @ self.rotation.T
        return keys.to(self.dtype)

    def dequantized_values(self) -> torch.Tensor:
        """The stored values in the model's dtype: `[B, H, stored_length, D]`."""
        codes = unpack(self.value_codes, self.bits).float()
        batch, heads, length, head_dim = codes.shape
        groups = codes.view(batch, heads, length, -1, self.value_group)
        values = groups * self.value_scales.float().unsqueeze(-1) + self.value_zeros.float().unsqueeze(-1)
        return values.view(batch, heads, length, head_dim).to(self.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and zeros, and the float window (with `capacity`, all that is allocated)."""
        tensors = [*self.buffers.values(), self._window_keys, self._window_values]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def float_nbytes(self) -> int:
        """Bytes a float32 cache of the same length would hold."""
        if not self.is_initialized:
            return 0
        batch, heads, _, head_dim = self._window_keys.shape
        return 2 * batch * heads * self.cumulative_length * head_dim * 4

    def _map_batch(self, function) -> None:
        """Replace every held tensor by `function` of it (a new batch order or selection)."""
        if not self.is_initialized:
            return
        self.buffers = {name: function(buffer) for name, buffer in self.buffers.items()}
        self._window_keys, self._window_values = function(self._window_keys), function(self._window_values)
        self.version += 1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search): the stored chunks' codes and statistics are selected, not re-quantized."""
        self._map_batch(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda tensor: tensor[indices, ...])

    def offload(self) -> None:
        self._map_batch(lambda tensor: tensor.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        self._map_batch(lambda tensor: tensor.to(self.device, non_blocking=True))

    def reset(self) -> None:
        """Drop everything held; the next `update` starts from scratch."""
        self._window_keys = self._window_values = None
        self.window_length = 0
        self.cumulative_length = 0
        self.is_initialized = False
        self._clear_stored()
        self.version += 1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a negative count, as `DynamicLayer.crop` takes).

        Tokens of a stored chunk that is cut are dequantized back into the float window (and will be
        quantized again with the chunk they join), so a crop into the stored chunks is lossy.
        """
        if tokens_to_remove > 0:
            raise ConfigError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(self.cumulative_length + tokens_to_remove, 0)
        if keep >= self.stored_length:
            window = keep - self.stored_length
            self._set_window(self.keys[..., :window, :].clone(), self.values[..., :window, :].clone())
        else:
            chunks = keep // self.residual_length
            stored = chunks * self.residual_length
            keys = self.dequantized_keys()[..., stored:keep, :]
            values = self.dequantized_values()[..., stored:keep, :]
            self._truncate_stored(chunks)
            self._set_window(keys, values)
        self.cumulative_length = keep

    def _truncate_stored(self, chunks: int) -> None:
        """Keep the first `chunks` stored chunks (without `capacity`, the rest is freed)."""
        self.stored_length = chunks * self.residual_length
        if self.capacity is None:
            self.buffers = {
                name: view.clone() for name in STORED_TENSORS if (view := self._view(name)) is not None and view.numel()
            }
            self.version += 1


class QuantizedKVCache(Cache):
    """A KV cache for decoder-only models holding keys and values in `bits` (8 or 4) once they leave
    a float window of `residual_length` tokens (see the module's docstring for the layouts).

    `rotate_keys` (default: on at 4 bits when head_dim is a power of two) rotates keys by a
    normalized Hadamard matrix before quantizing them, which spreads outlier channels.

    `capacity` (tokens) allocates every layer's storage once, on the first update, and lets the
    native decode step read and write it in place (8 bits, keys not rotated, one float32 sequence:
    `compile_for_decoding(model, kv_bits=8, native_step=True)` makes one per generation). Without it
    the storage grows with the tokens, holding only what is used.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        bits: int = 8,
        residual_length: int = 128,
        group_size: int = 64,
        rotate_keys: bool | None = None,
        capacity: int | None = None,
    ):
        text_config = config.get_text_config(decoder=True)
        _check_decoder(config, text_config)
        head_dim = attention_head_dim(text_config)
        if bits not in BITS:
            raise ConfigError(f"QuantizedKVCache bits must be 4 or 8, got {bits}")
        if not isinstance(residual_length, int) or residual_length < 1:
            raise ConfigError(f"QuantizedKVCache residual_length must be an integer >= 1, got {residual_length}")
        if not isinstance(group_size, int) or group_size < 1:
            raise ConfigError(f"QuantizedKVCache group_size must be an integer >= 1, got {group_size}")
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
            raise ConfigError(f"QuantizedKVCache capacity must be a number of tokens >= 1, got {capacity!r}")
        if bits == 4 and head_dim % 2:
            raise ConfigError(f"4-bit KV codes pack two a byte along head_dim, which is odd here ({head_dim})")
        power_of_two = head_dim & (head_dim - 1) == 0
        if rotate_keys is None:
            rotate_keys = bits == 4 and power_of_two
        elif rotate_keys and not power_of_two:
            raise ConfigError(f"rotate_keys needs a head_dim that is a power of two, got {head_dim}")
        layer_types, _ = get_layer_types_and_kwargs(text_config)
        others = sorted(set(layer_types) - {"full_attention"})
        if others:
            raise KVCacheModelError(
                f"QuantizedKVCache serves full-attention layers only; this model also has {', '.join(others)} layers"
            )
        self.bits, self.residual_length, self.group_size = bits, residual_length, group_size
        self.rotate_keys, self.capacity = rotate_keys, capacity
        layers = [QuantizedKVLayer(bits, residual_length, group_size, rotate_keys, capacity) for _ in layer_types]
        super().__init__(layers=layers)

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer: codes, scales and zeros, and the float windows."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def float_nbytes(self) -> int:
        """Bytes a float32 cache of the same length would hold."""
        return sum(layer.float_nbytes for layer in self.layers)


def attention_head_dim(config: PretrainedConfig) -> int:
    """head_dim of a decoder config (its `head_dim`, or hidden size over attention heads); refuses unknown shapes."""
    head_dim = getattr(config, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    if head_dim is None and heads and getattr(config, "hidden_size", None):
        head_dim = config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not head_dim or not kv_heads or getattr(config, "num_hidden_layers", None) is None:
        raise KVCacheModelError(
            f"QuantizedKVCache needs num_key_value_heads (or num_attention_heads), head_dim (or hidden_size) "
            f"and num_hidden_layers in the config; the {type(config).__name__} has not"
        )
    return int(head_dim)


def _check_decoder(config: PretrainedConfig, text_config: PretrainedConfig) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(text_config, "model_type", "")
    known_not_causal = model_type in CONFIG_MAPPING_NAMES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if (
        getattr(config, "is_encoder_decoder", False)
        or known_not_causal
        or getattr(text_config, "is_decoder", None) is False
    ):
        raise KVCacheModelError(
            f"QuantizedKVCache serves decoder-only causal LMs; "
            f"{model_type or type(config).__name__} is configured as an encoder"
        )


def quantize(
    x: torch.Tensor, dim: int, bits: int, stat_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric codes of float32 `x` over `dim`: `(codes uint8, scale, zero)`, with `x ~= codes * scale + zero`.

    The zero (the minimum) is rounded down and the scale up to `stat_dtype`, and the codes are
    computed from the stored statistics, so their rounding only widens the range a little.
    """
    levels = 2**bits - 1
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    zero = low.to(stat_dtype)
    zero = torch.where(zero.float() > low, torch.nextafter(zero, torch.full_like(zero, -math.inf)), zero)
    zero32 = zero.float()
    scale = ((high - zero32) / levels).clamp_min(1e-6) * (1 + 2**-9)
    scale = scale.to(stat_dtype)
    codes = torch.round((x - zero32) / scale.float()).clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """4-bit codes two a byte along the last dim (even index in the low nibble); 8-bit codes unchanged."""
    return codes if bits == 8 else codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`."""
    if bits == 8:
        return packed
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
