"""`TrainingArguments` from names and text values, as the library (not only the CLI) reads them."""

import pytest

from quantlab.errors import ConfigError
from quantlab.training import training_arguments


def test_bad_names_and_values_are_one_line_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="did you mean save_steps"):
        training_arguments({"output_dir": str(tmp_path), "save_step": 5})
    with pytest.raises(ConfigError, match=r"training argument seed='1\.5'"):
        training_arguments({"output_dir": str(tmp_path), "seed": "1.5"})
    with pytest.raises(ConfigError, match="optim"):
        training_arguments({"output_dir": str(tmp_path), "optim": "sgd_9bit"})
    with pytest.raises(ConfigError, match="choose one"):
        training_arguments({"output_dir": str(tmp_path), "bf16": True, "fp16": "true"})


def test_text_values_are_typed_as_transformers_types_them(tmp_path):
    args = training_arguments(
        {"output_dir": str(tmp_path), "max_steps": "10", "warmup_steps": "0.1", "activation_checkpointing": "true",
         "lr_scheduler_kwargs": '{"power": 2.0}', "save_steps": "0", "eval_steps": 5}
    )  # fmt: skip
    assert args.max_steps == 10 and args.warmup_steps == 0.1 and args.activation_checkpointing
    assert args.lr_scheduler_kwargs == {"power": 2.0}
    assert args.save_strategy == "no" and args.eval_strategy == "steps" and args.eval_steps == 5
