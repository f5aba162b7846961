"""GGUF files for tests: the tiny Llama written as llama.cpp names its tensors, and where a file's header fields sit.

`gguf_layout` finds the byte offsets of a file's counts, lengths and types with gguf-py's own
reader, so tests can damage one field at a time without parsing the header themselves.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import pre_tokenizers

from quantlab.testing.models import tiny_llama

# The tiny Llama's names, ours → llama.cpp's; per layer, the part after `model.layers.N.`.
_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """The tiny Llama as an F32 GGUF file with a byte-level tokenizer, as llama.cpp names its tensors."""
    import gguf

    model = tiny_llama(seed)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([])  # gguf-py drops an empty array: the file has no merges, and scores instead
    names = dict(_NAMES)
    for layer in range(config.num_hidden_layers):
        for ours, theirs in _LAYER_NAMES.items():
            names[f"model.layers.{layer}.{ours}.weight"] = f"blk.{layer}.{theirs}.weight"
    for name, tensor in model.state_dict().items():
        writer.add_tensor(names[name], tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True)
class EntryLayout:
    """Where one metadata entry's fields start: key length, value type, value (an array's element type)."""

    key_length: int
    value_type: int
    value: int


@dataclass(frozen=True)
class TensorLayout:
    """Where one tensor-table entry's fields start."""

    name_length: int
    n_dims: int
    dims: int
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GGUFLayout:
    """The byte offsets of a GGUF file's header fields; the counts sit at 8 (tensors) and 16 (entries)."""

    entries: dict[str, EntryLayout]
    tensors: dict[str, TensorLayout]
    data_offset: int

    tensor_count: int = 8
    kv_count: int = 16

    def length_fields(self) -> list[int]:
        """Every uint64 count or length in the header: the two counts, key, string and array lengths,
        tensor name lengths, dimensions and offsets."""
        fields = [self.tensor_count, self.kv_count]
        for entry in self.entries.values():
            fields.append(entry.key_length)
            fields.append(entry.value + 4)  # a string's length sits here; an array's count too
        for tensor in self.tensors.values():
            fields += [tensor.name_length, tensor.dims, tensor.offset]
        return fields

    def type_fields(self) -> list[int]:
        """Every uint32 type or dimension count in the header."""
        fields = [entry.value_type for entry in self.entries.values()]
        return fields + [at for tensor in self.tensors.values() for at in (tensor.n_dims, tensor.ggml_type)]


def gguf_layout(path: Path) -> GGUFLayout:
    """Where each header field of a readable GGUF file sits, as gguf-py's reader finds them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    entries = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value_type = field.offset + 8 + len(key.encode())
        entries[key] = EntryLayout(field.offset, value_type, value_type + 4)
    tensors = {}
    for tensor in reader.tensors:
        start = tensor.field.offset
        n_dims = start + 8 + len(tensor.name.encode())
        ggml_type = n_dims + 4 + 8 * len(tensor.shape)
        tensors[tensor.name] = TensorLayout(start, n_dims, n_dims + 4, ggml_type, ggml_type + 4)
    return GGUFLayout(entries, tensors, int(reader.data_offset))


def read_gguf_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF tensor name → (type name, float32 values in torch's order: `[out, in]`, `[experts, out, in]`), each
    decoded by gguf-py: what an independent reader finds in a file."""
    import gguf

    tensors = {}
    for tensor in gguf.GGUFReader(path).tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        tensors[tensor.name] = tensor.tensor_type.name, values.reshape(tuple(reversed(tensor.shape.tolist())))
    return tensors


# Token ids of the byte-level vocabulary the tiny models carry, for llama.cpp comparisons.
LLAMA_CPP_PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 100, 101, 102, 33, 34, 35, 36, 37]


def llama_cpp_logits(path: Path, tokens: list[int] = LLAMA_CPP_PROMPT) -> np.ndarray:
    """llama.cpp's logits (llama-cpp-python, the `peers` extra; one thread) at every position of `tokens`."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    try:
        llm.eval(tokens)
        return np.asarray(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()
