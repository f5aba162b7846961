"""`TrainingArguments` names for quantlab's `TrainingConfig`.

The training commands and `--training-arg name=value` speak the vocabulary of
`transformers.TrainingArguments`, so a user's flags and config files keep working when the loop
moves onto `transformers.Trainer`. Today the loop is quantlab's own; this module translates each
supported `TrainingArguments` field into the `TrainingConfig` field that has the same meaning,
and says so plainly when a field has no equivalent yet instead of ignoring it.
`TrainingConfig`'s own field names (e.g. `profile_steps`) are accepted too.
"""

import dataclasses
import difflib
import json
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from quantlab.errors import ConfigError
from quantlab.training.config import TrainingConfig

# TrainingArguments field -> TrainingConfig field of the same meaning.
RENAMED: dict[str, str] = {
    "output_dir": "output_dir",
    "max_steps": "max_steps",
    "learning_rate": "learning_rate",
    "per_device_train_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "lr_scheduler_type": "lr_scheduler",
    "lr_scheduler_kwargs": "scheduler_args",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
    "optim": "optim",
    "optim_args": "optim_args",
    "save_steps": "save_every",
    "save_total_limit": "keep_last",
    "logging_steps": "log_every",
    "eval_steps": "eval_every",
    "activation_checkpointing": "activation_checkpointing",
    "gradient_checkpointing": "activation_checkpointing",  # transformers 5: a deprecated alias of the above
    "torch_compile": "compile",
    "torch_empty_cache_steps": "empty_cache_every",
    "seed": "seed",
    "resume_from_checkpoint": "resume_from",
}
# TrainingArguments fields whose value sets a TrainingConfig field in another form.
TRANSLATED: tuple[str, ...] = ("warmup_steps", "bf16", "fp16", "disable_tqdm", "report_to")


def supported_names() -> list[str]:
    """Every name `training_config_values` accepts: the TrainingArguments ones, then quantlab's own."""
    own = [field.name for field in dataclasses.fields(TrainingConfig) if field.name not in RENAMED.values()]
    return sorted(RENAMED) + sorted(TRANSLATED) + sorted(own)


def training_config_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """`TrainingConfig` keyword arguments from `TrainingArguments`-named (or quantlab-named) values.

    Values may be typed (from JSON/YAML) or text (from the command line); text is converted
    to the field's type. An unknown name raises `ConfigError` naming the close matches; a
    `TrainingArguments` field quantlab's loop does not have yet raises `ConfigError` saying so.
    """
    result: dict[str, Any] = {}
    for name, value in values.items():
        if name in TRANSLATED:
            try:
                result.update(_TRANSLATORS[name](value, result))
            except (ValueError, TypeError) as error:
                if isinstance(error, ConfigError):
                    raise
                raise ConfigError(f"training argument {name}={value!r}: {error}") from error
            continue
        field = RENAMED.get(name) or _own_field(name)
        result[field] = _convert(name, field, value)
    return result


def _own_field(name: str) -> str:
    own = {field.name for field in dataclasses.fields(TrainingConfig)}
    if name in own:
        return name
    if name in _transformers_fields():
        raise ConfigError(
            f"TrainingArguments.{name} has no equivalent in quantlab's training loop yet; "
            f"supported: {', '.join(sorted(RENAMED) + sorted(TRANSLATED))}"
        )
    close = difflib.get_close_matches(name, supported_names(), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise ConfigError(f"unknown training argument {name!r}; {hint}see TrainingArguments for the names")


def _transformers_fields() -> set[str]:
    from transformers import TrainingArguments

    return {field.name for field in dataclasses.fields(TrainingArguments)}


# -- values ------------------------------------------------------------------------------------------


def _convert(name: str, field: str, value: Any) -> Any:
    annotation = typing.get_type_hints(TrainingConfig)[field]
    try:
        return _CONVERTERS.get(field, _by_annotation(annotation))(value)
    except (ValueError, TypeError, json.JSONDecodeError) as error:
        raise ConfigError(f"training argument {name}={value!r}: {error}") from error


def _by_annotation(annotation: Any) -> Callable[[Any], Any]:
    members = set(typing.get_args(annotation)) or {annotation}
    optional = type(None) in members
    members.discard(type(None))

    def convert(value: Any) -> Any:
        if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))):
            return None
        if bool in members:
            return _boolean(value)
        if int in members and float not in members:
            return _whole(value)
        if float in members:
            return float(value)
        if dict in members or typing.get_origin(annotation) is dict:
            return _mapping(value)
        return value if not isinstance(value, Path) else str(value)

    return convert


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    if str(value).strip().lower() not in words:
        raise ValueError("expects true or false")
    return words[str(value).strip().lower()]


def _whole(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError("expects a whole number")
    return int(value)


def _mapping(value: Any) -> dict[str, Any]:
    """A dict, JSON text, or TrainingArguments' `key=value,key=value` form (as `optim_args` takes)."""
    if isinstance(value, dict):
        return value
    text = str(value).strip()
    if text.startswith("{"):
        return json.loads(text)
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError("expects JSON or key=value,key=value")
    return {key.strip(): _scalar(raw.strip()) for key, raw in pairs}


def _scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _profile_steps(value: Any) -> tuple[int, int] | None:
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        return None
    parts = value.split(":") if isinstance(value, str) else list(value)
    if len(parts) != 2:
        raise ValueError("expects START:STOP, e.g. 2:4")
    return (_whole(parts[0]), _whole(parts[1]))


def _max_grad_norm(value: Any) -> float | None:
    """TrainingArguments turns clipping off with 0; quantlab with None."""
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        return None
    return float(value) or None


_CONVERTERS: dict[str, Callable[[Any], Any]] = {"profile_steps": _profile_steps, "max_grad_norm": _max_grad_norm}


def _precision(kind: str) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    def translate(value: Any, so_far: dict[str, Any]) -> dict[str, Any]:
        if _boolean(value):
            if so_far.get("precision", kind) != kind:
                raise ConfigError("bf16 and fp16 are both set; choose one")
            return {"precision": kind}
        return {"precision": "fp32"} if so_far.get("precision") == kind else {}

    return translate


def _report_to(value: Any, so_far: dict[str, Any]) -> dict[str, Any]:
    targets = [value] if isinstance(value, str) else list(value or [])
    targets = [target for item in targets for target in str(item).split(",") if target.strip()]
    unknown = set(targets) - {"none", "tensorboard", "all"}
    if unknown:
        raise ConfigError(
            f"report_to={value!r}: quantlab's loop logs to log.jsonl and TensorBoard only; "
            f"use report_to=tensorboard or report_to=none"
        )
    return {"tensorboard": bool(set(targets) & {"tensorboard", "all"})}


def _warmup(value: Any, so_far: dict[str, Any]) -> dict[str, Any]:
    """transformers 5: a whole number of steps, or a fraction in [0, 1) of the run (quantlab's `warmup_ratio`)."""
    number = float(value)
    if 0 < number < 1:
        return {"warmup_steps": 0, "warmup_ratio": number}
    if not number.is_integer():
        raise ConfigError(f"warmup_steps={value!r} must be a whole number of steps or a fraction in [0, 1)")
    return {"warmup_steps": int(number), "warmup_ratio": 0.0}


_TRANSLATORS: dict[str, Callable[[Any, dict[str, Any]], dict[str, Any]]] = {
    "warmup_steps": _warmup,
    "bf16": _precision("bf16"),
    "fp16": _precision("fp16"),
    "disable_tqdm": lambda value, so_far: {"progress_bar": not _boolean(value)},
    "report_to": _report_to,
}


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
