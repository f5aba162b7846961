"""Causal-LM data: held-out windows first, training text after, dynamic padding, sharded order."""

import json

import pytest
import torch

from quantlab.errors import QuantlabError
from quantlab.training import CausalLMCollator, TokenSequences, causal_lm_data, read_documents
from quantlab.training.data import IGNORE_INDEX


def test_collator_pads_to_the_longest_and_masks_labels():
    collate = CausalLMCollator(pad_token_id=0)
    batch = collate([{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8, 9])}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, 9, IGNORE_INDEX]]


def test_collator_masks_by_position_not_by_token_so_real_eos_is_learned():
    collate = CausalLMCollator(pad_token_id=0, pad_to_multiple_of=4)
    batch = collate([{"input_ids": torch.tensor([5, 0])}])
    assert batch["labels"].tolist() == [[5, 0, IGNORE_INDEX, IGNORE_INDEX]]


def test_text_holds_out_the_harness_windows_and_trains_on_the_rest(tokenizer):
    text = "".join(chr(97 + i % 26) for i in range(1000))
    data = causal_lm_data(tokenizer, [text], seq_len=100, eval_windows=4, eval_seq_len=64)
    ids = tokenizer(text)["input_ids"]
    assert data.eval_windows.tolist() == torch.tensor(ids[:256]).view(4, 64).tolist()
    trained = torch.cat(data.train.sequences).tolist()
    assert trained == ids[256:]  # everything after the windows, nothing before
    assert [len(s) for s in data.train.sequences] == [100] * 7 + [44]


def test_jsonl_documents_fill_the_windows_then_train(tokenizer, tmp_path):
    path = tmp_path / "docs.jsonl"
    documents = ["a" * 70, "b" * 70, "c" * 30, "d" * 250]
    path.write_text("\n".join(json.dumps({"text": d}) for d in documents) + "\n\n")
    assert read_documents(path) == documents
    data = causal_lm_data(tokenizer, read_documents(path), seq_len=100, eval_windows=2, eval_seq_len=64)
    assert data.eval_windows.shape == (2, 64)
    lengths = [len(s) for s in data.train.sequences]
    assert lengths == [31, 100, 100, 51]  # "c" + EOS, then "d" + EOS in pieces of at most 100


def test_bad_data_is_named(tokenizer, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(QuantlabError, match=r"docs.jsonl:2: no string field 'text'"):
        read_documents(path)
    path.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(QuantlabError, match=r"docs.jsonl:2: not valid JSON"):
        read_documents(path)
    with pytest.raises(QuantlabError, match="does not exist"):
        read_documents(tmp_path / "missing.txt")
    with pytest.raises(QuantlabError, match="fewer eval_windows"):
        causal_lm_data(tokenizer, ["short text"], seq_len=8, eval_windows=2, eval_seq_len=64)


def test_fingerprint_changes_with_the_data():
    a = TokenSequences([torch.tensor([1, 2, 3])])
    assert a.fingerprint() == TokenSequences([torch.tensor([1, 2, 3])]).fingerprint()
    assert a.fingerprint() != TokenSequences([torch.tensor([1, 2, 4])]).fingerprint()
