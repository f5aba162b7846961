"""Checkpoints: rotation, atomic writes, bit-identical resume, and refusing another run's folder."""

import pytest
import torch

from quantlab.methods.nf4 import NF4Config
from quantlab.training import Callback, ResumeError, Trainer, list_checkpoints
from quantlab.training import checkpoint as ckpt
from quantlab.training.reporting import read_log


class StopAt(Callback):
    """Interrupts the run (as Ctrl-C would) once `step` optimizer steps are done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_optimizer_step(self, trainer):
        if trainer.state.step == self.step:
            raise KeyboardInterrupt


def _resume_config(make_config, output_dir, **overrides):
    options = {"max_steps": 6, "batch_size": 4, "grad_accum": 2, "save_every": 2, "keep_last": 2}
    return make_config(output_dir, **{**options, **overrides})


def test_interrupted_run_resumes_bit_identically(make_qlora, make_data, make_config, tmp_path):
    """Dropout, shuffling across an epoch boundary, accumulation: all must line up after the resume."""
    data = make_data(count=20)  # 5 micro-batches per epoch: the run crosses two epoch boundaries
    uninterrupted = make_qlora(NF4Config(), dropout=0.1, checkpointing=True)
    Trainer(uninterrupted, _resume_config(make_config, tmp_path / "a"), data).train()

    interrupted = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        model = make_qlora(NF4Config(), dropout=0.1, checkpointing=True)
        Trainer(model, _resume_config(make_config, interrupted), data, callbacks=[StopAt(5)]).train()
    assert [p.name for p in list_checkpoints(interrupted)] == ["step-00000002", "step-00000004"]

    # Other adapter init, and other global RNG state: the checkpoint must restore both.
    resumed = make_qlora(NF4Config(), lora_seed=7, dropout=0.1, checkpointing=True)
    Trainer(resumed, _resume_config(make_config, interrupted, resume_from="latest"), data).train()

    expected = ckpt.trainable_parameters(uninterrupted)
    got = ckpt.trainable_parameters(resumed)
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert read_log(interrupted) == _without_timing(read_log(tmp_path / "a"), read_log(interrupted))


def _without_timing(reference, other):
    """The reference log with the other log's timing and memory fields (which differ run to run)."""
    volatile = ("tokens_per_second", "seconds_per_step", "peak_memory_mib", "memory_mib")
    return [{**a, **{k: b[k] for k in volatile if k in b}} for a, b in zip(reference, other, strict=True)]


def test_rotation_keeps_the_last_k(make_qlora, make_data, make_config, tmp_path):
    Trainer(make_qlora(), make_config(tmp_path, max_steps=5, save_every=1, keep_last=2), make_data()).train()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    files = {p.name for p in (tmp_path / "checkpoints" / "step-00000005").iterdir()}
    assert {"trainable.safetensors", "optimizer.json", "scheduler.safetensors", "random_states_0.json"} <= files
    assert ckpt.TrainerState.read(tmp_path / "checkpoints" / "step-00000005").step == 5


def test_a_failed_checkpoint_write_leaves_the_previous_one_usable(
    make_qlora, make_data, make_config, tmp_path, monkeypatch
):
    save = ckpt.save_trainable

    def full_disk_at_step_4(model, path):
        if "step-00000004" in str(path):
            raise OSError(28, "No space left on device")
        save(model, path)

    monkeypatch.setattr(ckpt, "save_trainable", full_disk_at_step_4)
    with pytest.raises(OSError, match="No space left"):
        Trainer(make_qlora(), make_config(tmp_path, max_steps=6, save_every=2), make_data()).train()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002"]
    assert not list((tmp_path / "checkpoints").glob(".*"))  # no half-written folder left behind

    monkeypatch.setattr(ckpt, "save_trainable", save)
    config = make_config(tmp_path, max_steps=6, save_every=2, resume_from="latest")
    result = Trainer(make_qlora(), config, make_data()).train()
    assert result.steps == 6
    assert [r["step"] for r in read_log(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_a_killed_writer_leaves_a_hidden_folder_that_is_ignored_and_cleaned(
    make_qlora, make_data, make_config, tmp_path
):
    Trainer(
        make_qlora(), make_config(tmp_path, max_steps=2, save_every=2, lr_scheduler="constant"), make_data()
    ).train()
    leftover = tmp_path / "checkpoints" / ".step-00000004.tmp-abc"
    leftover.mkdir()
    (leftover / "optimizer.json").write_bytes(b"half")
    assert ckpt.latest_checkpoint(tmp_path).name == "step-00000002"
    config = make_config(tmp_path, max_steps=3, save_every=2, resume_from="latest", lr_scheduler="constant")
    Trainer(make_qlora(), config, make_data()).train()
    assert not leftover.exists()


def test_resume_refuses_a_checkpoint_of_another_adapter_layout(make_qlora, make_data, make_config, tmp_path):
    Trainer(make_qlora(r=4), make_config(tmp_path, max_steps=2, save_every=2), make_data()).train()
    config = make_config(tmp_path, max_steps=3, resume_from="latest")
    with pytest.raises(ResumeError, match=r"belongs to another run: .*trainable_layout"):
        Trainer(make_qlora(r=8), config, make_data()).train()


def test_resume_refuses_a_checkpoint_of_another_model_or_data(make_qlora, make_data, make_config, tmp_path):
    Trainer(make_qlora(), make_config(tmp_path, max_steps=2, save_every=2), make_data()).train()
    with pytest.raises(ResumeError, match="model_config"):
        config = make_config(tmp_path, max_steps=3, resume_from="latest")
        Trainer(make_qlora(NF4Config()), config, make_data()).train()
    with pytest.raises(ResumeError, match="frozen_weights"):  # same architecture, other weights
        config = make_config(tmp_path, max_steps=3, resume_from="latest")
        Trainer(make_qlora(seed=5), config, make_data()).train()
    with pytest.raises(ResumeError, match="data"):
        config = make_config(tmp_path, max_steps=3, resume_from="latest")
        Trainer(make_qlora(), config, make_data(seed=1)).train()


@pytest.mark.parametrize(
    ("model_options", "config_options", "difference"),
    [
        ({"alpha": 16}, {}, "adapter.default.lora_alpha: checkpoint 8, this run 16"),
        ({"dropout": 0.1}, {}, "adapter.default.lora_dropout: checkpoint 0.0, this run 0.1"),
        ({}, {"learning_rate": 5e-3}, "learning_rate: checkpoint 0.01, this run 0.005"),
        ({}, {"weight_decay": 0.1}, "weight_decay"),
        ({}, {"max_grad_norm": 0.5}, "max_grad_norm"),
        ({}, {"lr_scheduler": "cosine"}, "lr_scheduler"),
        ({}, {"max_steps": 5}, "max_steps: checkpoint 4, this run 5"),  # the linear decay's length
    ],
)
def test_resume_refuses_other_hyperparameters(
    model_options, config_options, difference, make_qlora, make_data, make_config, tmp_path
):
    Trainer(make_qlora(), make_config(tmp_path, max_steps=4, save_every=2), make_data()).train()
    config = make_config(tmp_path, **{"max_steps": 4, "resume_from": "latest", **config_options})
    with pytest.raises(ResumeError, match="belongs to another run") as refused:
        Trainer(make_qlora(**model_options), config, make_data()).train()
    assert difference in str(refused.value)


def test_resume_latest_without_a_checkpoint_says_so(make_qlora, make_data, make_config, tmp_path):
    with pytest.raises(ResumeError, match="holds no complete checkpoint"):
        Trainer(make_qlora(), make_config(tmp_path, resume_from="latest"), make_data()).train()
    with pytest.raises(ResumeError, match="neither a checkpoint"):
        Trainer(make_qlora(), make_config(tmp_path, resume_from=tmp_path), make_data()).train()


def test_a_new_run_will_not_mix_into_another_runs_folder(make_qlora, make_data, make_config, tmp_path):
    Trainer(make_qlora(), make_config(tmp_path, max_steps=2, save_every=2), make_data()).train()
    with pytest.raises(ResumeError, match="resume_from='latest'"):
        Trainer(make_qlora(), make_config(tmp_path, max_steps=2), make_data()).train()
