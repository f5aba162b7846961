"""`TrainingArguments` names onto quantlab's `TrainingConfig`, as the library (not only the CLI) reads them."""

import pytest

from quantlab.errors import ConfigError
from quantlab.training import TrainingConfig
from quantlab.training.arguments import training_config_values


def test_training_arguments_names_become_training_config_fields(tmp_path):
    values = training_config_values(
        {
            "output_dir": tmp_path,
            "max_steps": "10",
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": "4",
            "lr_scheduler_type": "cosine",
            "warmup_steps": 0.1,  # transformers 5: a fraction below 1 is a ratio
            "save_steps": 5,
            "save_total_limit": 1,
            "logging_steps": 2,
            "gradient_checkpointing": "true",  # transformers 5's deprecated alias of activation_checkpointing
            "optim_args": "eps=1e-6,decouple=true",  # TrainingArguments' key=value form
            "disable_tqdm": True,
            "report_to": ["none"],
        }
    )
    config = TrainingConfig(**values)
    assert (config.max_steps, config.batch_size, config.grad_accum) == (10, 2, 4)
    assert (config.warmup_steps, config.warmup_ratio, config.num_warmup_steps) == (0, 0.1, 1)
    assert (config.save_every, config.keep_last, config.log_every) == (5, 1, 2)
    assert config.activation_checkpointing and not config.progress_bar and not config.tensorboard
    assert config.optim_args == {"eps": 1e-6, "decouple": True}


def test_quantlab_names_pass_too_and_whole_warmup_is_steps():
    values = training_config_values({"keep_last": 3, "warmup_steps": "7", "precision": "bf16"})
    assert values == {"keep_last": 3, "warmup_steps": 7, "warmup_ratio": 0.0, "precision": "bf16"}


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"neftune_noise_alpha": 5}, "TrainingArguments.neftune_noise_alpha has no equivalent in quantlab"),
        ({"save_step": 5}, "did you mean save_steps"),
        ({"warmup_steps": 2.5}, "whole number of steps or a fraction"),
        ({"bf16": True, "fp16": True}, "choose one"),
        ({"seed": "1.5"}, "training argument seed='1.5'"),
    ],
)
def test_bad_names_and_values_raise_config_error(values, fragment):
    with pytest.raises(ConfigError, match=None) as caught:
        training_config_values(values)
    assert fragment in str(caught.value)
