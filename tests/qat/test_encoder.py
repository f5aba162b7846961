"""QAT of an encoder (a sentence-embedding model): trained on its last hidden states, one example a line."""

import json

import pytest
import torch
from transformers import AutoModel

import quantlab
from quantlab.assets.text import text_lines
from quantlab.calibration.data import ENCODER_EVAL_LINES as EVAL_LINES
from quantlab.cli.main import main
from quantlab.distill import DistillationConfig
from quantlab.distill.loss import EncoderDistillationLoss, distillation_loss
from quantlab.errors import ConfigError
from quantlab.eval.embeddings import embedding_cosines, sentence_embeddings
from quantlab.nn import QuantizedLinear
from quantlab.qat import train_quantized
from quantlab.testing import byte_tokenizer, tiny_bert, tiny_llama, tiny_llama_checkpoint
from quantlab.training import training_arguments
from quantlab.training.encoder_data import encoder_examples

LINES = [f"line {i}: " + "some words of text " * (1 + i % 5) for i in range(64)]


def _args(tmp_path, steps: int, lr: float = 0.02):
    return training_arguments({"output_dir": str(tmp_path / "run"), "max_steps": steps, "learning_rate": lr,
                               "per_device_train_batch_size": 8, "lr_scheduler_type": "constant",
                               "save_strategy": "no", "seed": 0})  # fmt: skip


def _mean_cosine(student, teacher, tokenizer, lines) -> float:
    reference = sentence_embeddings(teacher, tokenizer, lines)
    return float(embedding_cosines(sentence_embeddings(student, tokenizer, lines), reference).mean())


def test_an_encoder_trains_against_its_float_models_hidden_states_and_keeps_its_format(tmp_path):
    teacher, tokenizer = tiny_bert(0), byte_tokenizer()
    student = quantlab.quantize(tiny_bert(0), quantlab.CustomBitsConfig(bits=2, group_size=32, symmetric=True))
    held_out = [f"line {i}: " + "some words of text " * (1 + i % 5) for i in range(64, 80)]  # not trained on
    before = _mean_cosine(student, teacher, tokenizer, held_out)
    train = encoder_examples(tokenizer, ["\n".join(LINES)], max_length=48)
    assert len(train) == len(LINES) and max(len(s) for s in train.sequences) <= 48
    result = train_quantized(student, teacher, _args(tmp_path, 40), train, tokenizer,
                             distillation=DistillationConfig(alpha=1.0))  # fmt: skip
    assert result.layers == 2 * 6 + 1 and len(result.losses) == 40  # six a block, and the pooler
    assert all(isinstance(student.get_submodule(f"encoder.layer.{i}.output.dense"), QuantizedLinear) for i in (0, 1))
    after = _mean_cosine(student, teacher, tokenizer, held_out)
    assert 1 - after < 0.7 * (1 - before), (before, after)
    student.save_pretrained(tmp_path / "saved")
    reloaded = AutoModel.from_pretrained(tmp_path / "saved")
    assert _mean_cosine(reloaded, teacher, tokenizer, held_out) == pytest.approx(after, abs=1e-6)


def test_the_encoder_loss_is_the_token_mean_cosine_distance_and_takes_no_soft_targets():
    teacher, student = tiny_bert(0), tiny_bert(1)
    loss = distillation_loss(student, DistillationConfig(alpha=1.0))
    assert isinstance(loss, EncoderDistillationLoss)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    class Holder:
        def __init__(self) -> None:
            self.extra_modules = {"teacher": teacher}

    output = loss(Holder(), student, batch, int(loss.count_items(batch)))
    with torch.no_grad():
        s, t = (m(input_ids=ids, attention_mask=mask).last_hidden_state for m in (student, teacher))
    expected = (1 - torch.nn.functional.cosine_similarity(s[mask.bool()], t[mask.bool()], dim=-1)).mean()
    assert int(loss.count_items(batch)) == 16
    assert float(output.loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(ConfigError, match=r"encoder.*alpha must be 1"):
        distillation_loss(student, DistillationConfig(alpha=0.5))


class _Holder:
    def __init__(self, teacher) -> None:
        self.extra_modules = {"teacher": teacher}


def _padded_batch(rows: int, lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (rows, max(lengths)), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_the_sentence_embedding_term_counts_every_example_once_and_adds_up_over_micro_batches():
    teacher, student = tiny_bert(0), tiny_bert(1)
    batch = _padded_batch(3, [10, 3, 7], seed=0)
    mask = batch["attention_mask"]
    with torch.no_grad():
        s, t = (m(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state for m in (student, teacher))
    tokens = (1 - torch.nn.functional.cosine_similarity(s[mask.bool()], t[mask.bool()], dim=-1)).mean()
    pooled_s, pooled_t = ((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True) for h in (s, t))
    lines = 1 - torch.nn.functional.cosine_similarity(pooled_s, pooled_t, dim=-1)  # one term an example
    loss = distillation_loss(student, DistillationConfig(alpha=1.0, embedding_weight=0.5))
    output = loss(_Holder(teacher), student, batch, int(loss.count_items(batch)))
    assert float(output.loss.detach()) == pytest.approx(float(tokens + 0.5 * lines.mean()), rel=1e-5)
    assert float(output.metrics["embedding_distance"]) == pytest.approx(float(lines.mean()), rel=1e-5)
    assert float(lines.mean()) != pytest.approx(float((lines * mask.sum(1)).sum() / mask.sum()), rel=1e-3)

    # two micro-batches of one step: each takes its share of the step's tokens, so they add up to the token term
    # and a token-weighted mean of their examples' means
    halves = [{key: value[rows] for key, value in batch.items()} for rows in (slice(0, 1), slice(1, 3))]
    step_tokens = int(mask.sum())
    outputs = [loss(_Holder(teacher), student, half, step_tokens) for half in halves]
    assert float(sum(o.metrics["cosine_distance"] for o in outputs)) == pytest.approx(float(tokens), rel=1e-5)
    expected = (10 * lines[0] + 10 * lines[1:].mean()) / step_tokens
    assert float(sum(o.metrics["embedding_distance"] for o in outputs)) == pytest.approx(float(expected), rel=1e-5)


def test_the_sentence_embedding_term_is_refused_for_a_causal_lm():
    with pytest.raises(ConfigError, match=r"causal language model: embedding_weight"):
        distillation_loss(tiny_llama(0), DistillationConfig(alpha=1.0, embedding_weight=1.0))


def test_the_bundled_texts_evaluation_lines_are_not_trained_on():
    from quantlab.assets.text import bundled_text

    tokenizer = byte_tokenizer()
    lines = text_lines(bundled_text())
    train = encoder_examples(tokenizer, None, max_length=512)
    first = tokenizer(lines[EVAL_LINES], truncation=True, max_length=512)["input_ids"]
    assert len(train) == len(lines) - EVAL_LINES
    assert train.sequences[0].tolist() == first


def test_quantlab_qat_on_an_encoder_reports_the_embedding_cosine(tmp_path, capsys):
    teacher = tiny_llama_checkpoint(tmp_path / "float", model=tiny_bert(0))
    code = main(["quantize", str(teacher), "--method", "custom_bits", "--bits", "2", "--group-size", "32",
                 "--symmetric", "-o", str(tmp_path / "q2"), "--quiet"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    argv = ["qat", str(tmp_path / "q2"), "--max-steps", "12", "--batch-size", "8", "--learning-rate", "0.02",
            "--embedding-weight", "1", "--eval", "-o", str(tmp_path / "run"), "--json"]  # fmt: skip
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report["perplexity_after"] is None and report["evaluation_text"].startswith(f"the first {EVAL_LINES}")
    assert 0 < report["embedding_cosine_before"] < report["embedding_cosine_after"] <= 1
    assert report["embedding_weight"] == 1.0
    reloaded = AutoModel.from_pretrained(tmp_path / "run" / "final")
    assert isinstance(reloaded.encoder.layer[0].attention.self.query, QuantizedLinear)
    code = main(["qat", str(tmp_path / "q2"), "--max-steps", "2", "--alpha", "0.5", "-o", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "encoder" in err
