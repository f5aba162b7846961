"""Checkpoints: bit-identical resume, rotation, atomic writes, and refusing another run's folder."""

import pytest
import torch
from transformers import TrainerCallback

from quantlab.errors import QuantlabError
from quantlab.methods.nf4 import NF4Config
from quantlab.training import ResumeError, Trainer, latest_checkpoint, list_checkpoints, read_log, trainable_parameters
from quantlab.training import checkpoints as ckpt


class StopAt(TrainerCallback):
    """Interrupts the run (as Ctrl-C would) once `step` optimizer steps are done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt


def _resume_config(make_config, output_dir, **overrides):
    options = {"max_steps": 6, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "save_steps": 2}
    return make_config(output_dir, **{**options, **overrides})


def _names(run_dir):
    return [p.name for p in list_checkpoints(run_dir)]


def test_interrupted_run_resumes_bit_identically(make_qlora, make_data, make_config, tmp_path):
    """N steps straight == N/2, interrupt, resume, N/2: dropout, shuffling across epochs, accumulation all line up."""
    data = make_data(count=20)  # 5 micro-batches per epoch: the run crosses two epoch boundaries
    uninterrupted = make_qlora(NF4Config(), dropout=0.1, checkpointing=True)
    Trainer(uninterrupted, _resume_config(make_config, tmp_path / "a"), data).train()

    interrupted = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        model = make_qlora(NF4Config(), dropout=0.1, checkpointing=True)
        Trainer(model, _resume_config(make_config, interrupted), data, callbacks=[StopAt(5)]).train()
    assert _names(interrupted) == ["checkpoint-2", "checkpoint-4"]

    # Other adapter init, and other global RNG state: the checkpoint must restore both.
    torch.manual_seed(1234)
    resumed = make_qlora(NF4Config(), lora_seed=7, dropout=0.1, checkpointing=True)
    Trainer(resumed, _resume_config(make_config, interrupted), data).train(resume_from_checkpoint="latest")

    expected, got = trainable_parameters(uninterrupted), trainable_parameters(resumed)
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    losses = [[r["loss"] for r in read_log(run) if "loss" in r] for run in (tmp_path / "a", interrupted)]
    assert len(losses[0]) == 6 and losses[0] == losses[1]


def test_rotation_keeps_the_last_k_and_no_pickle(make_qlora, make_data, make_config, tmp_path):
    Trainer(make_qlora(), make_config(tmp_path, max_steps=5, save_steps=1, save_total_limit=2), make_data()).train()
    assert _names(tmp_path) == ["checkpoint-4", "checkpoint-5"]
    files = {p.name for p in (tmp_path / "checkpoint-5").iterdir()}
    assert {"trainable.safetensors", "optimizer.json", "scheduler.safetensors", "random_states_0.json"} <= files
    assert {"manifest.json", "trainer_state.json"} <= files
    assert all(name.endswith((".json", ".safetensors")) for name in files)


def test_a_failed_checkpoint_write_leaves_the_previous_one_usable(
    make_qlora, make_data, make_config, tmp_path, monkeypatch
):
    save = ckpt.save_trainable

    def full_disk_at_step_4(model, path):
        if "checkpoint-4" in str(path):
            raise OSError(28, "No space left on device")
        save(model, path)

    monkeypatch.setattr(ckpt, "save_trainable", full_disk_at_step_4)
    with pytest.raises(QuantlabError, match=r"no space left on the device .*checkpoint-2, is intact"):
        Trainer(make_qlora(), make_config(tmp_path, max_steps=6, save_steps=2), make_data()).train()
    assert _names(tmp_path) == ["checkpoint-2"]
    assert not list(tmp_path.glob(".*"))  # no half-written folder left behind

    monkeypatch.setattr(ckpt, "save_trainable", save)
    trainer = Trainer(make_qlora(), make_config(tmp_path, max_steps=6, save_steps=2), make_data())
    assert trainer.train(resume_from_checkpoint="latest").global_step == 6
    assert [r["step"] for r in read_log(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_a_half_written_hidden_folder_is_never_resumed_and_is_cleaned(make_qlora, make_data, make_config, tmp_path):
    options = {"save_steps": 2, "lr_scheduler_type": "constant"}
    Trainer(make_qlora(), make_config(tmp_path, max_steps=2, **options), make_data()).train()
    leftover = tmp_path / ".checkpoint-4.tmp-abc"  # what a killed writer leaves
    leftover.mkdir()
    (leftover / "optimizer.json").write_bytes(b"half")
    unfinished = tmp_path / "checkpoint-6"  # a folder of the right name without a manifest: not a checkpoint
    unfinished.mkdir()
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"
    Trainer(make_qlora(), make_config(tmp_path, max_steps=3, **options), make_data()).train("latest")
    assert not leftover.exists()


def test_resume_refuses_a_checkpoint_of_another_adapter_layout(make_qlora, make_data, make_config, tmp_path):
    Trainer(make_qlora(r=4), make_config(tmp_path, max_steps=2, save_steps=2), make_data()).train()
    with pytest.raises(ResumeError, match=r"belongs to another run: .*trainable_layout"):
        Trainer(make_qlora(r=8), make_config(tmp_path, max_steps=2), make_data()).train("latest")


def test_resume_refuses_a_checkpoint_of_another_model_or_data(make_qlora, make_data, make_config, tmp_path):
    Trainer(make_qlora(), make_config(tmp_path, max_steps=2, save_steps=2), make_data()).train()
    config = make_config(tmp_path, max_steps=2)
    with pytest.raises(ResumeError, match="model_config"):
        Trainer(make_qlora(NF4Config()), config, make_data()).train("latest")
    with pytest.raises(ResumeError, match="frozen_weights"):  # same architecture, other weights
        Trainer(make_qlora(seed=5), config, make_data()).train("latest")
    with pytest.raises(ResumeError, match="data"):
        Trainer(make_qlora(), config, make_data(seed=1)).train("latest")


@pytest.mark.parametrize(
    ("model_options", "config_options", "difference"),
    [
        ({"alpha": 16}, {}, "adapter.default.lora_alpha: checkpoint 8, this run 16"),
        ({"dropout": 0.1}, {}, "adapter.default.lora_dropout: checkpoint 0.0, this run 0.1"),
        ({}, {"learning_rate": 5e-3}, "learning_rate: checkpoint 0.01, this run 0.005"),
        ({}, {"weight_decay": 0.1}, "weight_decay"),
        ({}, {"max_grad_norm": 0.5}, "max_grad_norm"),
        ({}, {"lr_scheduler_type": "cosine"}, "lr_scheduler_type"),
        ({}, {"per_device_train_batch_size": 2}, "per_device_train_batch_size"),
        ({}, {"max_steps": 5}, "max_steps: checkpoint 4, this run 5"),  # the linear decay's length
    ],
)
def test_resume_refuses_other_hyperparameters(
    model_options, config_options, difference, make_qlora, make_data, make_config, tmp_path
):
    Trainer(make_qlora(), make_config(tmp_path, max_steps=4, save_steps=2), make_data()).train()
    config = make_config(tmp_path, **{"max_steps": 4, **config_options})
    with pytest.raises(ResumeError, match="belongs to another run") as refused:
        Trainer(make_qlora(**model_options), config, make_data()).train("latest")
    assert difference in str(refused.value)


def test_resume_latest_without_a_checkpoint_says_so(make_qlora, make_data, make_config, tmp_path):
    with pytest.raises(ResumeError, match="holds no complete checkpoint"):
        Trainer(make_qlora(), make_config(tmp_path), make_data()).train("latest")
    with pytest.raises(ResumeError, match="neither a checkpoint"):
        Trainer(make_qlora(), make_config(tmp_path), make_data()).train(tmp_path)


def test_a_new_run_will_not_mix_into_another_runs_folder(make_qlora, make_data, make_config, tmp_path):
    Trainer(make_qlora(), make_config(tmp_path, max_steps=2, save_steps=2), make_data()).train()
    with pytest.raises(ResumeError, match="resume_from_checkpoint='latest'"):
        Trainer(make_qlora(), make_config(tmp_path, max_steps=2), make_data()).train()
