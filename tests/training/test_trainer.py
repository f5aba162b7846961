"""The shared loop on tiny models: losses, accumulation, schedules, clipping, logging, callbacks, extra modules."""

import math

import pytest
import torch
from torch import nn

from quantlab.errors import ConfigError
from quantlab.methods.nf4 import NF4Config
from quantlab.training import (
    Callback,
    LossOutput,
    PrecisionError,
    Trainer,
    UnknownOptimizerError,
    predicted_tokens,
)
from quantlab.training.checkpoint import trainable_parameters
from quantlab.training.reporting import read_log

LOG_KEYS = {
    "step",
    "epoch",
    "loss",
    "lr",
    "grad_norm",
    "tokens",
    "tokens_per_second",
    "seconds_per_step",
    "peak_memory_mib",
    "memory_mib",
    "optimizer_state_mib",
}


def test_qlora_loss_falls_and_the_log_has_every_figure(make_qlora, make_data, make_config, tmp_path):
    model = make_qlora(NF4Config(), checkpointing=True)
    config = make_config(tmp_path, max_steps=8, learning_rate=3e-2, lr_scheduler="constant")
    result = Trainer(model, config, make_data()).train()
    log = read_log(tmp_path)
    assert [r["step"] for r in log] == list(range(1, 9))
    assert all(r.keys() >= LOG_KEYS for r in log)
    assert log[-1]["loss"] < log[0]["loss"] - 0.2
    assert result.loss == log[-1]["loss"] and result.steps == 8
    assert all(r["optimizer_state_mib"] > 0 and r["peak_memory_mib"] > 0 and r["tokens"] > 0 for r in log)
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()


def test_accumulated_micro_batches_equal_one_large_batch(make_qlora, make_data, make_config, tmp_path):
    """Token-exact losses: 2 x 2 accumulated examples of varied length update like one batch of 4."""
    runs = []
    for batch_size, grad_accum in ((4, 1), (2, 2)):
        model = make_qlora()
        output_dir = tmp_path / f"{batch_size}x{grad_accum}"
        config = make_config(output_dir, max_steps=3, batch_size=batch_size, grad_accum=grad_accum)
        Trainer(model, config, make_data()).train()
        runs.append((trainable_parameters(model), read_log(config.output_dir)))
    (large, large_log), (accumulated, accumulated_log) = runs
    for name in large:
        torch.testing.assert_close(accumulated[name], large[name], rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(large_log, accumulated_log, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["tokens"] == b["tokens"]


@pytest.mark.parametrize(
    ("schedule", "warmup", "expected"),
    [
        ("constant_with_warmup", {"warmup_steps": 2}, [0.5, 1.0, 1.0, 1.0]),
        ("linear", {"warmup_ratio": 0.5}, [0.5, 1.0, 0.5, 0.0]),
        ("cosine", {}, [math.cos(math.pi * s / 4) / 2 + 0.5 for s in (1, 2, 3, 4)]),
        ("constant", {}, [1.0, 1.0, 1.0, 1.0]),
    ],
)
def test_learning_rate_follows_the_schedule(schedule, warmup, expected, make_qlora, make_data, make_config, tmp_path):
    config = make_config(tmp_path, lr_scheduler=schedule, learning_rate=1e-3, **warmup)
    Trainer(make_qlora(), config, make_data()).train()
    assert [r["lr"] for r in read_log(tmp_path)] == pytest.approx([1e-3 * f for f in expected])


def test_gradients_are_clipped_to_max_grad_norm(make_qlora, make_data, make_config, tmp_path):
    trainer = Trainer(make_qlora(), make_config(tmp_path, max_steps=2, max_grad_norm=1e-3), make_data())
    norms = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    trainer.train()
    logged = [r["grad_norm"] for r in read_log(tmp_path)]
    assert all(n == pytest.approx(1e-3, rel=1e-3) for n in norms)
    assert all(n > 1e-2 for n in logged)  # the log reports the norm before clipping


def test_eval_profile_and_cache_release(make_qlora, make_data, make_config, tmp_path):
    windows = torch.arange(64).view(2, 32) % 13 + 10
    config = make_config(tmp_path, eval_every=2, profile_steps=(1, 2), empty_cache_every=1)
    result = Trainer(make_qlora(), config, make_data(), eval_windows=windows).train()
    evaluations = [r for r in read_log(tmp_path) if "eval_perplexity" in r]
    assert [r["step"] for r in evaluations] == [0, 2, 4]
    assert evaluations[-1]["eval_perplexity"] < evaluations[0]["eval_perplexity"]
    assert result.eval_perplexity == evaluations[-1]["eval_perplexity"]
    assert (tmp_path / "profile" / "trace-rank0.json").stat().st_size > 0
    assert "aten::" in (tmp_path / "profile" / "summary-rank0.txt").read_text()


def test_tensorboard_receives_the_log(make_qlora, make_data, make_config, tmp_path):
    pytest.importorskip("tensorboard")
    Trainer(make_qlora(), make_config(tmp_path, max_steps=2, tensorboard=True), make_data()).train()
    assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_bf16_autocast_trains(make_qlora, make_data, make_config, tmp_path):
    result = Trainer(make_qlora(NF4Config()), make_config(tmp_path, max_steps=2, precision="bf16"), make_data()).train()
    assert math.isfinite(result.loss)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs where CUDA is")
def test_fp16_without_a_gpu_is_refused(make_qlora, make_data, make_config, tmp_path):
    with pytest.raises(PrecisionError, match="use precision='bf16' or 'fp32'"):
        Trainer(make_qlora(), make_config(tmp_path, precision="fp16"), make_data())


def test_unknown_optimizer_lists_the_known_ones(make_config, tmp_path):
    with pytest.raises(UnknownOptimizerError, match=r"adamw_8bit.*paged_adamw_8bit"):
        make_config(tmp_path, optim="sgd_9bit")


def test_bad_options_are_named(make_config, tmp_path):
    with pytest.raises(ConfigError, match="warmup_ratio"):
        make_config(tmp_path, warmup_ratio=1.5)
    with pytest.raises(ConfigError, match="precision"):
        make_config(tmp_path, precision="fp8")


def test_a_model_with_nothing_to_train_is_refused(make_data, make_config, tmp_path):
    from quantlab.errors import QuantlabError
    from quantlab.testing import tiny_llama

    with pytest.raises(QuantlabError, match="no trainable parameter"):
        Trainer(tiny_llama().requires_grad_(False), make_config(tmp_path), make_data())


class Recorder(Callback):
    """Records the hooks it sees, and counts steps as state that must survive a resume."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.counted = 0

    def on_train_begin(self, trainer):
        self.events.append("begin")

    def on_step_begin(self, trainer):
        self.events.append("step")

    def on_before_optimizer_step(self, trainer):
        assert all(p.grad is not None for p in trainer.model.parameters() if p.requires_grad)
        self.events.append("before")

    def on_optimizer_step(self, trainer):
        self.counted += 1
        self.events.append("after")

    def on_log(self, trainer, logs):
        self.events.append("log")

    def on_save(self, trainer, checkpoint_dir):
        self.events.append("save")

    def on_train_end(self, trainer):
        self.events.append("end")

    def state_dict(self):
        return {"counted": self.counted}

    def load_state_dict(self, state):
        self.counted = state["counted"]


def test_callbacks_run_in_order_and_keep_their_state(make_qlora, make_data, make_config, tmp_path):
    recorder = Recorder()
    config = make_config(tmp_path, max_steps=2, save_every=2, lr_scheduler="constant")  # constant: may run longer
    Trainer(make_qlora(), config, make_data(), callbacks=[recorder]).train()
    assert recorder.events == [
        "begin",
        "step",
        "before",
        "after",
        "log",
        "step",
        "before",
        "after",
        "log",
        "save",
        "end",
    ]
    resumed = Recorder()
    config = make_config(tmp_path, max_steps=3, save_every=2, resume_from="latest", lr_scheduler="constant")
    Trainer(make_qlora(), config, make_data(), callbacks=[resumed]).train()
    assert resumed.counted == 3


class ProjectedHiddenLoss:
    """A distillation-shaped loss: next-token loss plus matching a frozen teacher's hidden state."""

    def __call__(self, trainer, model, batch, num_items):
        teacher, projection = trainer.extra_modules["teacher"], trainer.extra_modules["projection"]
        outputs = model(**batch, output_hidden_states=True, num_items_in_batch=num_items)
        with torch.no_grad():
            target = teacher(input_ids=batch["input_ids"], output_hidden_states=True).hidden_states[-1]
        mask = batch["attention_mask"][:, 1:].unsqueeze(-1)
        gap = (projection(outputs.hidden_states[-1]) - target).pow(2).mean(-1, keepdim=True)[:, 1:]
        matching = (gap * mask).sum() / num_items
        return LossOutput(loss=outputs.loss + matching, metrics={"hidden_mse": matching})


def test_extra_modules_frozen_teacher_and_trained_projection(make_qlora, make_data, make_config, tmp_path):
    from quantlab.testing import tiny_llama

    teacher = tiny_llama(seed=3).requires_grad_(False).train()
    teacher_weights = {n: p.clone() for n, p in teacher.named_parameters()}
    projection = nn.Linear(64, 64)
    projection_before = projection.weight.detach().clone()
    extra = {"teacher": teacher, "projection": projection}
    config = make_config(tmp_path, max_steps=3, save_every=3)
    Trainer(make_qlora(), config, make_data(), loss=ProjectedHiddenLoss(), extra_modules=extra).train()
    assert not teacher.training
    assert all(torch.equal(p, teacher_weights[n]) for n, p in teacher.named_parameters())
    assert not torch.equal(projection.weight, projection_before)
    log = read_log(tmp_path)
    assert all(r["hidden_mse"] > 0 for r in log) and log[-1]["hidden_mse"] < log[0]["hidden_mse"]
    assert (tmp_path / "checkpoints" / "step-00000003" / "trainable_1.safetensors").is_file()


def test_predicted_tokens_skip_padding_and_the_first_position():
    labels = torch.tensor([[5, 6, 7, -100], [5, 6, -100, -100]])
    assert predicted_tokens({"labels": labels}) == 3
