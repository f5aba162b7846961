"""`quantlab prune`'s steps as library calls: pruning by pattern name, then recovery (fine-tuning or distillation)."""

import copy
from types import SimpleNamespace

import pytest
import torch

from quantlab.distill import DistillationConfig, recover
from quantlab.errors import ConfigError
from quantlab.prune import mask_of, masked_layers
from quantlab.prune.pipeline import first_examples, pattern_sparsity, prune_by_pattern
from quantlab.testing import tiny_llama
from quantlab.training import TokenSequences, training_arguments

TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=1)  # what the collator reads of a tokenizer


def _data(count: int = 32, seed: int = 0) -> TokenSequences:
    generator = torch.Generator().manual_seed(seed)
    return TokenSequences([torch.randint(0, 256, (16,), generator=generator) for _ in range(count)])


def _arguments(output_dir, steps: int = 3):
    values = {"output_dir": str(output_dir), "max_steps": steps, "per_device_train_batch_size": 4,
              "learning_rate": 1e-3, "lr_scheduler_type": "constant", "disable_tqdm": True}  # fmt: skip
    return training_arguments(values)


@pytest.mark.parametrize(
    ("pattern", "sparsity", "head_sparsity", "message"),
    [
        ("2:4", 0.7, 0.0, "sparsity 0.5"),
        ("unstructured", None, 0.0, "needs a sparsity"),
        ("structured", None, 0.0, "and/or head_sparsity"),
        ("2:4", None, 0.5, "structured only"),
        ("structured", 0.25, 1.5, "head_sparsity=1.5"),
    ],
)
def test_options_that_do_not_fit_the_pattern_are_refused_before_pruning(pattern, sparsity, head_sparsity, message):
    with pytest.raises(ConfigError, match=message):
        pattern_sparsity(pattern, sparsity, head_sparsity)


def test_prune_by_pattern_masks_or_shrinks():
    masked = tiny_llama(0)
    outcome = prune_by_pattern(masked, "2:4")
    assert outcome.sparsity == pytest.approx(0.5) and outcome.layers == len(masked_layers(masked)) > 0
    shrunk = tiny_llama(0)
    before = shrunk.model.layers[0].mlp.up_proj.out_features
    outcome = prune_by_pattern(shrunk, "structured", 0.5, calibration=first_examples(_data(), 2))
    assert shrunk.model.layers[0].mlp.up_proj.out_features == before // 2 and not masked_layers(shrunk)
    assert outcome.sparsity == pytest.approx(0.5) and outcome.layers == shrunk.config.num_hidden_layers


@pytest.mark.parametrize("from_teacher", [False, True])
def test_recovery_trains_the_live_weights_and_keeps_the_masks(tmp_path, from_teacher):
    model = tiny_llama(0)
    teacher = copy.deepcopy(model) if from_teacher else None
    prune_by_pattern(model, "unstructured", 0.5)
    masks = {name: mask_of(layer).clone() for name, layer in masked_layers(model).items()}
    before = {name: layer.weight.detach().clone() for name, layer in masked_layers(model).items()}
    distillation = DistillationConfig(alpha=1.0) if from_teacher else None
    losses = recover(model, _arguments(tmp_path), _data(), TOKENIZER, teacher=teacher, distillation=distillation)
    assert len(losses) == 3 and not model.training
    for name, layer in masked_layers(model).items():
        assert torch.equal(mask_of(layer), masks[name]) and not layer.weight[~masks[name]].any()
        assert not torch.equal(layer.weight, before[name])
