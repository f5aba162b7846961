"""quantlab's `Trainer` (transformers.Trainer) on tiny models: exact token-weighted losses, evaluation, log, options."""

import math

import pytest
import torch
from transformers import TrainerCallback

from quantlab.errors import QuantlabError
from quantlab.methods.nf4 import NF4Config
from quantlab.training import Trainer, read_log, trainable_parameters


def _train_log(tmp_path):
    return [r for r in read_log(tmp_path) if "loss" in r]


def test_qlora_loss_falls_and_the_log_has_every_figure(make_qlora, make_data, make_config, tmp_path):
    model = make_qlora(NF4Config(), checkpointing=True)
    config = make_config(tmp_path, max_steps=8, learning_rate=3e-2, lr_scheduler_type="constant")
    result = Trainer(model, config, make_data()).train()
    log = _train_log(tmp_path)
    assert [r["step"] for r in log] == list(range(1, 9))
    assert all(r.keys() >= {"loss", "grad_norm", "learning_rate", "epoch"} for r in log)
    assert log[-1]["loss"] < log[0]["loss"] - 0.2
    assert result.global_step == 8
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "final" / "training_args.json").is_file()  # not transformers' pickled training_args.bin
    assert (tmp_path / "trainer_state.json").is_file()  # transformers' own state: the log is its log_history
    assert not list(tmp_path.rglob("*.bin")) and not list(tmp_path.rglob("*.pt*"))


def test_accumulated_micro_batches_equal_one_large_batch(make_qlora, make_data, make_config, tmp_path):
    """Token-exact losses (transformers' num_items_in_batch): 2 x 2 examples of varied length update like 1 x 4."""
    runs = []
    for batch_size, accumulation in ((4, 1), (2, 2), (1, 4)):
        model = make_qlora()
        output_dir = tmp_path / f"{batch_size}x{accumulation}"
        config = make_config(
            output_dir, max_steps=3, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation
        )
        Trainer(model, config, make_data()).train()
        runs.append((trainable_parameters(model), _train_log(output_dir)))
    (large, large_log), *accumulated_runs = runs
    for accumulated, accumulated_log in accumulated_runs:
        for name in large:
            torch.testing.assert_close(accumulated[name], large[name], rtol=1e-4, atol=1e-6, msg=name)
        for a, b in zip(large_log, accumulated_log, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_the_loss_is_the_mean_over_tokens_not_over_examples(make_qlora, make_data, make_config, tmp_path):
    """The first logged loss equals the model's own token-mean loss over the same 4 examples in one padded batch."""
    from quantlab.training import CausalLMCollator

    data = make_data()
    model = make_qlora()
    config = make_config(tmp_path, max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    trainer = Trainer(model, config, data)
    order = list(trainer.get_train_dataloader().batch_sampler)[:2]  # the examples of step 1, as Trainer draws them
    batch = CausalLMCollator(0)([data[i] for indices in order for i in indices])
    with torch.no_grad():
        expected = float(model(**batch).loss)
    trainer.train()
    assert _train_log(tmp_path)[0]["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    ("schedule", "warmup", "expected"),
    [
        ("constant_with_warmup", {"warmup_steps": 2}, [0.0, 0.5, 1.0, 1.0]),
        ("linear", {"warmup_steps": 0.5}, [0.0, 0.5, 1.0, 0.5]),
        ("cosine", {}, [math.cos(math.pi * s / 4) / 2 + 0.5 for s in (0, 1, 2, 3)]),
        ("constant", {}, [1.0, 1.0, 1.0, 1.0]),
    ],
)
def test_learning_rate_follows_the_schedule(schedule, warmup, expected, make_qlora, make_data, make_config, tmp_path):
    """The log has the rate each step used (transformers logs it before the scheduler advances)."""
    config = make_config(tmp_path, lr_scheduler_type=schedule, learning_rate=1e-3, **warmup)
    Trainer(make_qlora(), config, make_data()).train()
    assert [r["learning_rate"] for r in _train_log(tmp_path)] == pytest.approx([1e-3 * f for f in expected])


def test_held_out_perplexity_is_the_harness_formula_and_falls(make_qlora, make_data, make_config, tmp_path):
    from quantlab.training import heldout_perplexity

    windows = torch.arange(64).view(2, 32) % 13 + 10
    config = make_config(tmp_path, eval_steps=2, eval_on_start=True)
    model = make_qlora()
    before = heldout_perplexity(model, windows)
    Trainer(model, config, make_data(), eval_windows=windows).train()
    evaluations = [r for r in read_log(tmp_path) if "eval_perplexity" in r]
    assert [r["step"] for r in evaluations] == [0, 2, 4]
    assert evaluations[0]["eval_perplexity"] == pytest.approx(before)
    assert evaluations[-1]["eval_perplexity"] < evaluations[0]["eval_perplexity"]
    assert evaluations[-1]["eval_perplexity"] == pytest.approx(heldout_perplexity(model, windows))


def test_bf16_autocast_trains(make_qlora, make_data, make_config, tmp_path):
    result = Trainer(make_qlora(NF4Config()), make_config(tmp_path, max_steps=2, bf16=True), make_data()).train()
    assert math.isfinite(result.training_loss)


def test_a_model_with_nothing_to_train_is_refused(make_data, make_config, tmp_path):
    from quantlab.testing import tiny_llama

    with pytest.raises(QuantlabError, match="no trainable parameter"):
        Trainer(tiny_llama().requires_grad_(False), make_config(tmp_path), make_data())


class Recorder(TrainerCallback):
    """Counts optimizer steps as state that must survive a resume."""

    def __init__(self) -> None:
        self.counted = 0

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.counted += 1

    def state_dict(self):
        return {"counted": self.counted}

    def load_state_dict(self, state):
        self.counted = state["counted"]


def test_callbacks_with_state_are_checkpointed(make_qlora, make_data, make_config, tmp_path):
    options = {"save_steps": 2, "lr_scheduler_type": "constant"}  # constant: the run may be resumed longer
    Trainer(make_qlora(), make_config(tmp_path, max_steps=2, **options), make_data(), callbacks=[Recorder()]).train()
    resumed = Recorder()
    trainer = Trainer(make_qlora(), make_config(tmp_path, max_steps=3, **options), make_data(), callbacks=[resumed])
    trainer.train(resume_from_checkpoint="latest")
    assert resumed.counted == 3


def test_without_a_progress_bar_each_log_record_is_a_line_on_stderr(
    make_qlora, make_data, make_config, tmp_path, capsys
):
    from transformers.utils import logging as hf_logging

    def run(folder, verbosity):
        hf_logging.set_verbosity(verbosity)
        config = make_config(tmp_path / folder, max_steps=2, logging_steps=1)
        Trainer(make_qlora(NF4Config()), config, make_data()).train()
        return capsys.readouterr()

    before = hf_logging.get_verbosity()
    try:
        out, err = run("lines", hf_logging.WARNING)  # transformers' default
        quiet = run("quiet", hf_logging.ERROR)  # what --quiet and --json set
    finally:
        hf_logging.set_verbosity(before)
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step 1/2: loss ") and "learning_rate" in lines[0] and "total_flos" not in err
    assert lines[1].startswith("step 2/2: loss ")
    assert "{" not in out  # transformers' dict printer is gone: stdout is the caller's
    assert "step 1/2" not in quiet.err
