"""`TrainingArguments` from names and values as a user writes them (flags, `name=value`, JSON/YAML files).

Names are `TrainingArguments` fields, unchanged; text values are converted exactly as
transformers' own argument parser (`HfArgumentParser`) converts them. quantlab only changes a few
defaults for its runs (`QUANTLAB_DEFAULTS`: log every step, no reporting service; `use_cpu` where
there is no GPU, which bf16 autocast and gloo DDP on CPU need) and turns
`save_steps`/`eval_steps` of 0 into "never". An unknown name or a bad value is a `ConfigError`
(one line, with the close names).
"""

import argparse
import dataclasses
import difflib
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quantlab.errors import ConfigError

QUANTLAB_DEFAULTS: dict[str, Any] = {
    "logging_steps": 1,
    "report_to": "none",
    "save_total_limit": 2,
    "include_num_input_tokens_seen": "non_padding",  # tokens per second in the log
    "dataloader_pin_memory": False,  # pinning needs an accelerator; on CPU it only warns
}


@functools.cache
def _parser() -> argparse.ArgumentParser:
    from transformers import HfArgumentParser, TrainingArguments

    return HfArgumentParser(TrainingArguments)


def field_names() -> set[str]:
    from transformers import TrainingArguments

    return {field.name for field in dataclasses.fields(TrainingArguments) if field.init}


def convert_value(name: str, value: Any) -> Any:
    """`value` typed as `TrainingArguments.name` wants it; non-text values pass unchanged."""
    if name not in field_names():
        close = difflib.get_close_matches(name, sorted(field_names()), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ConfigError(f"unknown training argument {name!r}; {hint}names are TrainingArguments fields")
    action = _parser()._option_string_actions.get("--" + name)
    if not isinstance(value, str) or action is None or action.type is None:
        return value
    if value.lower() in ("none", "null") and action.default is None:
        return None
    try:
        converted = action.type(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as error:
        raise ConfigError(f"training argument {name}={value!r}: {error}") from error
    if action.choices and converted not in action.choices:
        raise ConfigError(f"training argument {name}={value!r}: choose one of {', '.join(map(str, action.choices))}")
    return converted


def training_arguments(values: Mapping[str, Any], **fixed: Any):
    """`TrainingArguments(**values)` with quantlab's defaults under them and `fixed` over them."""
    import torch
    from transformers import TrainingArguments

    given = {**QUANTLAB_DEFAULTS, **{name: convert_value(name, value) for name, value in values.items()}, **fixed}
    given.setdefault("use_cpu", not torch.cuda.is_available())  # bf16 autocast and gloo DDP on a CPU-only machine
    for steps, strategy in (("save_steps", "save_strategy"), ("eval_steps", "eval_strategy")):
        if steps in given and strategy not in given:
            given[strategy] = "steps" if given[steps] else "no"
            given[steps] = given[steps] or None
    if given.get("bf16") and given.get("fp16"):
        raise ConfigError("bf16 and fp16 are both set; choose one")
    try:
        return TrainingArguments(**given)
    except (ValueError, TypeError, ImportError) as error:
        raise ConfigError(f"training arguments: {str(error).strip().splitlines()[0]}") from error


def read_training_arguments_file(path: str | Path) -> dict[str, Any]:
    """The name -> value mapping of a JSON or YAML file (as `TrainingArguments` would be written)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"training arguments file {path}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as error:  # yaml.YAMLError or json.JSONDecodeError: a file the user wrote
        raise ConfigError(f"training arguments file {path} is not valid {path.suffix[1:].upper()}: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"training arguments file {path} must hold a mapping of names to values")
    return data
