"""The tokenizer keys of a GGUF file, as llama.cpp's converter writes them for byte-level BPE tokenizers.

`tokenizer.ggml.model` is "gpt2" (byte-level BPE); the token list runs over the model's whole
vocabulary (ids the tokenizer lacks become unused `[PAD<i>]` tokens); each token's type says
whether it is normal, a control token (special) or user-defined (added, not special); the merges
come from the tokenizer's BPE model. `tokenizer.ggml.pre` names the pre-tokenizer llama.cpp must
run: like the converter, it is recognised by the hash of the token ids of `CHECK_TEXT`.
"""

import json
from dataclasses import dataclass
from hashlib import sha256
from typing import Any

from quantlab.export.gguf.errors import GGUFExportError, require_gguf

# The converter's probe text: its tokens tell pre-tokenizers apart (spaces, digits, scripts, apostrophes).
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# sha256 of str(tokenizer.encode(CHECK_TEXT)) → llama.cpp's pre-tokenizer, for the supported families.
PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
}
DEFAULT_PRE_TOKENIZER = "default"

# gguf.TokenType
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
_SPECIAL_IDS = ("bos", "eos", "unk", "pad", "sep", "cls", "mask")


@dataclass(frozen=True)
class Vocabulary:
    """What the GGUF file says about the tokenizer; `pre_recognised` is False when `pre` is a fallback."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    pre_recognised: bool
    special_ids: dict[str, int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool | None
    chat_template: str | None

    def write(self, writer: Any) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        # Written even when empty (a bare byte-level tokenizer has no merges): llama.cpp requires the key
        # for a "gpt2" vocabulary, and transformers would otherwise derive merges from scores this file lacks.
        kinds = require_gguf().GGUFValueType
        writer.add_key_value("tokenizer.ggml.merges", self.merges, kinds.ARRAY, sub_type=kinds.STRING)
        for kind, token_id in self.special_ids.items():
            getattr(writer, f"add_{kind}_token_id")(token_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)


def vocabulary(tokenizer: Any, vocab_size: int) -> Vocabulary:
    """The GGUF tokenizer keys of a transformers fast tokenizer for a model of `vocab_size` tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFExportError(
            f"the tokenizer ({type(tokenizer).__name__}) is not a fast tokenizer; GGUF export reads tokenizer.json"
        )
    spec = json.loads(backend.to_str())
    model, pre_tokenizer = spec.get("model") or {}, spec.get("pre_tokenizer")
    byte_level = _find(pre_tokenizer, "ByteLevel")
    if model.get("type") != "BPE" or byte_level is None:
        raise GGUFExportError(
            f"the tokenizer is {model.get('type', 'unknown')} without byte-level pre-tokenization; GGUF export "
            f"writes byte-level BPE tokenizers (GPT-2 style: Llama 3, SmolLM2, Qwen2)"
        )
    ids = tokenizer.get_vocab()
    if max(ids.values(), default=-1) >= vocab_size:
        raise GGUFExportError(
            f"the tokenizer has ids up to {max(ids.values())} but the model's vocabulary has {vocab_size} tokens"
        )
    tokens, types = _tokens(tokenizer, ids, vocab_size)
    digest = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    pre = PRE_TOKENIZERS.get(digest)
    probe = tokenizer.encode("a")
    plain = tokenizer.encode("a", add_special_tokens=False)
    special_ids = {
        kind: token_id
        for kind in _SPECIAL_IDS
        if (token_id := getattr(tokenizer, f"{kind}_token_id", None)) is not None
    }
    template = getattr(tokenizer, "chat_template", None)
    return Vocabulary(
        tokens=tokens,
        token_types=types,
        merges=[m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []],
        pre=pre or DEFAULT_PRE_TOKENIZER,
        pre_recognised=pre is not None,
        special_ids=special_ids,
        add_bos=len(probe) > len(plain) and probe[0] == special_ids.get("bos"),
        add_eos=len(probe) > len(plain) and probe[-1] == special_ids.get("eos"),
        add_space_prefix=byte_level.get("add_prefix_space"),
        chat_template=template if isinstance(template, str) else None,
    )


def _tokens(tokenizer: Any, ids: dict[str, int], vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id's token text and type, as the converter lists them."""
    by_id = {token_id: token for token, token_id in ids.items()}
    added = tokenizer.get_added_vocab()
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    tokens, types = [], []
    for token_id in range(vocab_size):
        token = by_id.get(token_id)
        if token is None:
            tokens.append(f"[PAD{token_id}]")
            types.append(UNUSED)
        elif token in added:
            special = getattr(decoder.get(token_id), "special", False) or _looks_special(token)
            tokens.append(token)
            types.append(CONTROL if special else USER_DEFINED)
        else:
            tokens.append(token)
            types.append(NORMAL)
    return tokens, types


def _looks_special(token: str) -> bool:
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<s>", "</s>", "<pad>", "<unk>", "<mask>")


def _find(node: Any, kind: str) -> dict | None:
    """The first component of type `kind` in a tokenizer.json pre-tokenizer (possibly a Sequence)."""
    if not isinstance(node, dict):
        return None
    if node.get("type") == kind:
        return node
    for child in node.get("pretokenizers") or []:
        if (found := _find(child, kind)) is not None:
            return found
    return None
