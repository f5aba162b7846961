import math

import pytest
import torch

from quantlab.errors import QuantlabError
from quantlab.eval import perplexity
from quantlab.eval.perplexity import checkpoint_perplexity
from quantlab.testing import tiny_llama

TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # 1,800 byte tokens


def reference_perplexity(model, ids: list[int], seq_len: int, windows: int) -> float:
    """Independent computation: next-token negative log-likelihood from the logits, in float64."""
    total, count = 0.0, 0
    for w in range(windows):
        window = torch.tensor(ids[w * seq_len : (w + 1) * seq_len]).unsqueeze(0)
        with torch.no_grad():
            logits = model(window).logits[0, :-1].double()
        log_probs = torch.log_softmax(logits, dim=-1)
        targets = window[0, 1:]
        total -= log_probs[torch.arange(len(targets)), targets].sum().item()
        count += len(targets)
    return math.exp(total / count)


@pytest.mark.parametrize(("seq_len", "windows"), [(64, 4), (100, 3), (128, 1)])
def test_harness_matches_independent_computation(tokenizer, seq_len, windows):
    model = tiny_llama()
    ids = tokenizer(TEXT)["input_ids"]
    expected = reference_perplexity(model, ids, seq_len, windows)
    assert perplexity(model, tokenizer, TEXT, seq_len=seq_len, windows=windows) == pytest.approx(expected, rel=1e-5)


def test_only_the_first_windows_are_scored(tokenizer):
    model = tiny_llama()
    changed_tail = TEXT[:256] + "completely different words follow here " * 10
    first = perplexity(model, tokenizer, TEXT, seq_len=64, windows=4)
    assert perplexity(model, tokenizer, changed_tail, seq_len=64, windows=4) == first
    assert perplexity(model, tokenizer, TEXT, seq_len=64, windows=5) != first


def test_text_too_short_names_its_length_and_the_fix(tokenizer):
    with pytest.raises(QuantlabError, match=r"has 1800 tokens.*pass windows=3 or less"):
        perplexity(tiny_llama(), tokenizer, TEXT, seq_len=512, windows=16)


def test_text_shorter_than_one_window_suggests_a_shorter_window(tokenizer):
    with pytest.raises(QuantlabError, match=r"has 10 tokens.*pass seq_len=10 or less"):
        perplexity(tiny_llama(), tokenizer, "ten bytes!", seq_len=64, windows=1)


def test_bad_window_arguments_raise(tokenizer):
    with pytest.raises(QuantlabError, match="seq_len >= 2"):
        perplexity(tiny_llama(), tokenizer, TEXT, seq_len=1, windows=4)


def test_training_mode_is_restored(tokenizer):
    model = tiny_llama().train()
    perplexity(model, tokenizer, TEXT, seq_len=64, windows=2)
    assert model.training


def test_non_float32_compute_warns(tokenizer):
    model = tiny_llama().to(torch.bfloat16)
    with pytest.warns(UserWarning, match="float32 compute"):
        perplexity(model, tokenizer, TEXT, seq_len=64, windows=1)


def test_progress_bar_only_when_asked(tokenizer, capsys):
    model = tiny_llama()
    perplexity(model, tokenizer, TEXT, seq_len=64, windows=2)
    assert "window" not in capsys.readouterr().err
    perplexity(model, tokenizer, TEXT, seq_len=64, windows=2, progress=True)
    assert "perplexity" in capsys.readouterr().err


def test_checkpoint_perplexity_equals_in_memory(tokenizer, tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    expected = perplexity(model, tokenizer, TEXT, seq_len=64, windows=3)
    assert checkpoint_perplexity(tmp_path / "model", TEXT, seq_len=64, windows=3) == pytest.approx(expected, rel=1e-6)


def test_checkpoint_without_tokenizer_says_where_to_find_one(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(QuantlabError, match="tokenizer_dir"):
        checkpoint_perplexity(tmp_path, TEXT)
