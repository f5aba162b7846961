"""Pruning as Trainer callbacks: masks hold through optimizer steps, the schedule, resume."""

import pytest
import torch
from transformers import TrainerCallback

from quantlab.errors import ConfigError
from quantlab.prune import GradualPruning, KeepMasks, cubic_sparsity, mask_of, masked_layers, prune
from quantlab.testing import tiny_llama
from quantlab.training import TokenSequences, Trainer, read_log, training_arguments


def _data(count: int = 32, length: int = 16) -> TokenSequences:
    generator = torch.Generator().manual_seed(0)
    return TokenSequences([torch.randint(0, 256, (length,), generator=generator) for _ in range(count)])


def _config(output_dir, **overrides):
    options = {
        "output_dir": str(output_dir),
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "weight_decay": 0.1,  # decay pulls every weight, momentum keeps moving them: masks must win
        "lr_scheduler_type": "constant",
        "disable_tqdm": True,
    }
    return training_arguments({**options, **overrides})


def _log(output_dir) -> list[dict]:
    records = read_log(output_dir)
    return [record for record in records if "loss" in record]  # the step records


def _train_model(model):
    model.train()
    return model


def test_masks_survive_every_optimizer_step(tmp_path):
    model = _train_model(tiny_llama())
    prune(model, "unstructured", 0.5)
    masks = {name: mask_of(layer).clone() for name, layer in masked_layers(model).items()}
    before = {name: layer.weight.detach().clone() for name, layer in masked_layers(model).items()}

    class CheckEveryStep(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):  # runs after KeepMasks, first in the list
            for name, layer in masked_layers(model).items():
                assert not bool(layer.weight[~masks[name]].any()), f"{name} revived a pruned weight"

    Trainer(model, _config(tmp_path), _data(), callbacks=[KeepMasks(), CheckEveryStep()]).train()
    for name, layer in masked_layers(model).items():
        assert torch.equal(mask_of(layer), masks[name])
        assert not bool(layer.weight[~masks[name]].any())
        assert not torch.equal(layer.weight[masks[name]], before[name][masks[name]])  # live weights trained
    assert _log(tmp_path)[-1]["sparsity"] == pytest.approx(0.5)


def test_without_keep_masks_the_optimizer_revives_pruned_weights(tmp_path):
    """The control of the test above: the masks hold because of the callback, not by accident."""
    model = _train_model(tiny_llama())
    prune(model, "unstructured", 0.5)
    Trainer(model, _config(tmp_path), _data()).train()
    layer = model.model.layers[0].mlp.up_proj
    assert bool(layer.weight[~mask_of(layer)].any())


def test_gradual_pruning_follows_the_cubic_schedule(tmp_path):
    model = _train_model(tiny_llama())
    schedule = GradualPruning(0.8, start_step=1, end_step=5, frequency=2, initial_sparsity=0.2)
    Trainer(model, _config(tmp_path, max_steps=7), _data(), callbacks=[schedule]).train()
    logged = [record["sparsity"] for record in _log(tmp_path) if "sparsity" in record]
    expected = [0.0] + [cubic_sparsity(step, 0.2, 0.8, 1, 5, 2) for step in range(1, 7)]
    assert logged == pytest.approx(expected, abs=1e-3)
    assert logged[-1] == pytest.approx(0.8, abs=1e-3)
    for layer in masked_layers(model).values():
        assert float((layer.weight == 0).float().mean()) == pytest.approx(0.8, abs=1e-2)


def test_gradual_nm_pruning_applies_the_pattern_at_the_start_step(tmp_path):
    model = _train_model(tiny_llama())
    schedule = GradualPruning(pattern="2:4", end_step=2)
    Trainer(model, _config(tmp_path, max_steps=3), _data(), callbacks=[schedule]).train()
    for layer in masked_layers(model).values():
        assert bool(((layer.weight != 0).reshape(layer.weight.shape[0], -1, 4).sum(-1) <= 2).all())


class _Interrupt(Exception):
    pass


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise _Interrupt


def test_resumed_gradual_pruning_matches_the_uninterrupted_run(tmp_path):
    def schedule():
        return GradualPruning(0.75, end_step=6, frequency=2)

    straight = _train_model(tiny_llama())
    Trainer(straight, _config(tmp_path / "straight", max_steps=6), _data(), callbacks=[schedule()]).train()

    first = _train_model(tiny_llama())
    config = _config(tmp_path / "resumed", max_steps=6, save_steps=3)
    with pytest.raises(_Interrupt):
        Trainer(first, config, _data(), callbacks=[schedule(), _StopAt(4)]).train()
    resumed = _train_model(tiny_llama())  # a fresh process would start from the unpruned model
    Trainer(resumed, config, _data(), callbacks=[schedule()]).train(resume_from_checkpoint="latest")

    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for name, layer in masked_layers(straight).items():
        assert torch.equal(mask_of(layer), mask_of(masked_layers(resumed)[name]))


def test_schedule_arguments_are_checked():
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        GradualPruning(1.0, end_step=10)
    with pytest.raises(ConfigError, match="exceeds"):
        GradualPruning(0.3, initial_sparsity=0.5, end_step=10)
    with pytest.raises(ConfigError, match="start_step <= end_step"):
        GradualPruning(0.5, start_step=10, end_step=5)
    with pytest.raises(ConfigError, match="structured"):
        GradualPruning(0.5, end_step=5, pattern="structured")
