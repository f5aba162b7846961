"""The base class of every quantlab method config.

A config is a dataclass (its fields are the method's options: the CLI builds its flags from
them) and a transformers `QuantizationConfigMixin` (so it rides in `config.json` and in
`from_pretrained(quantization_config=...)`). It serializes with a `format_version`, so a
checkpoint written by a newer, incompatible quantlab is refused with a clear message.
"""

import dataclasses
import math
import typing
from typing import Any, ClassVar, Literal

import torch
from transformers.utils.quantization_config import QuantizationConfigMixin

from quantlab.errors import ConfigError
from quantlab.solvers import Solver, get_solver

FORMAT_VERSION = 1
TRANSFORMERS_PREFIX = "quantlab_"
DEFAULT_SOLVER = "rtn"
EMBEDDING_BITS = (4, 8)  # the widths embedding_bits accepts, inclusive
EMBEDDING_GROUP_SIZE = 64
ROTATION_BLOCK_RULES = ("power_of_two", "largest")
EXPERT_CALIBRATIONS = ("routed", "all")  # `rotation_blocks`, read by quantlab.nn.rotation
SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def transformers_name(method: str) -> str:
    """The `quant_method` a quantlab method carries in transformers (namespaced, so `hqq` can't clash)."""
    return TRANSFORMERS_PREFIX + method


@dataclasses.dataclass
class QuantlabConfig(QuantizationConfigMixin):
    """Options shared by every method. Subclasses set `method` and add their own fields.

    `modules_to_not_convert`: module names (or name suffixes) kept in float. `None` keeps
    transformers' own choice: the output head and tied embeddings.

    `embedding_bits`: also store the input embedding table and the output head in this many bits
    (8: int8; 4-7: symmetric integer codes), in groups of `embedding_group_size` along each row
    with float16 scales. A head tied to the embeddings computes its logits from the same stored
    codes, so the table is stored once. `None` keeps both in float. These two options, not
    `modules_to_not_convert`, decide what happens to the embedding table and the output head.

    `solver` chooses how codes are found (`quantlab.solvers`): `rtn` and `mse` need no data
    and run while `from_pretrained` streams the weights in; `gptq`, `reconstruct` (and `awq`) calibrate
    block by block on `calibration_samples` windows of `calibration_seq_len` tokens from
    `calibration_text` (default: the bundled WikiText-2 after the evaluation windows), or, with
    `self_calibration`, on windows the float model samples itself (no data needed: GPTQ on NF4
    this way is quantlab's data-free solver that beats round-to-nearest at the same size).
    """

    method: ClassVar[str] = ""
    format_version: ClassVar[int] = FORMAT_VERSION

    # Set from `method` in `__post_init__`; the mixin declares it as a required field.
    quant_method: str = dataclasses.field(default="", init=False, repr=False)
    modules_to_not_convert: list[str] | None = None
    solver: str = dataclasses.field(
        default=DEFAULT_SOLVER,
        metadata={"help": "how codes are chosen: rtn, mse (data-free), gptq, reconstruct (calibrated), plugins"},
    )
    solver_options: dict[str, Any] | None = dataclasses.field(
        default=None, metadata={"help": 'the solver\'s options as JSON, e.g. {"damp": 0.01, "act_order": true}'}
    )
    awq: bool = dataclasses.field(
        default=False, metadata={"help": "activation-aware channel scaling before the solver (calibrated)"}
    )
    calibration_text: str | None = dataclasses.field(
        default=None,
        metadata={"help": "text or JSONL file to calibrate on (default: bundled WikiText-2 after the eval windows)"},
    )
    self_calibration: bool = dataclasses.field(
        default=False,
        metadata={"help": "calibrate on text the float model samples itself: no data needed (causal LMs)"},
    )
    calibration_samples: int = dataclasses.field(default=128, metadata={"help": "calibration windows"})
    calibration_seq_len: int = dataclasses.field(default=256, metadata={"help": "tokens per calibration window"})
    target_bits: float | None = dataclasses.field(
        default=None,
        metadata={"help": "mixed precision: stored bits per quantized weight to allocate across layers"},
    )
    layer_options: dict[str, dict[str, Any]] | None = dataclasses.field(
        default=None,
        metadata={
            "help": "per-layer option overrides as JSON: {layer name: {option: value}}; with target_bits these "
            "layers keep them and the budget is spent on the others"
        },
    )
    rotate_inputs: list[str] | None = dataclasses.field(
        default=None,
        metadata={
            "help": "layers (names or suffixes, e.g. down_proj) whose input is rotated by a Hadamard matrix on "
            "every call and whose weight is quantized rotated: spreads outlier channels (SpinQuant's R4)"
        },
    )
    rotation_blocks: Literal["power_of_two", "largest"] = dataclasses.field(
        default="power_of_two",
        metadata={
            "help": "the Hadamard block a rotated layer uses: power_of_two (the largest power of two dividing its "
            "inputs: 64 of 576, 512 of 1,536) or largest (the largest Hadamard order dividing them: whole rows "
            "of 576 or 1,536)"
        },
    )
    expert_calibration: Literal["routed", "all"] = dataclasses.field(
        default="routed",
        metadata={
            "help": "a mixture of experts' calibration statistics: routed (each expert from the tokens routed to "
            "it; an expert given too few is quantized data-free, and named) or all (every expert from every token)"
        },
    )
    embedding_bits: int | None = dataclasses.field(
        default=None,
        metadata={"help": "store the embedding table and output head (tied: once) in 4-8 bits; none keeps float"},
    )
    embedding_group_size: int | None = dataclasses.field(
        default=EMBEDDING_GROUP_SIZE,
        metadata={"help": "weights per scale along each embedding row with --embedding-bits (channel: one per row)"},
    )

    # Set by `config_for` on the config of one layer named in `rotate_inputs`: the layer rotates its input.
    # Resolved per layer, so not an option: never saved, no flag (`option_names` leaves it out).
    input_rotated: bool = dataclasses.field(default=False, repr=False, metadata={"resolved_per_layer": True})

    def __post_init__(self) -> None:
        self.quant_method = transformers_name(self.method)
        if isinstance(self.rotate_inputs, str):
            self.rotate_inputs = [self.rotate_inputs]
        if isinstance(self.modules_to_not_convert, str):
            self.modules_to_not_convert = [self.modules_to_not_convert]  # one name, not its characters
        if self.modules_to_not_convert is not None and not isinstance(self.modules_to_not_convert, list):
            self.modules_to_not_convert = list(self.modules_to_not_convert)
        if self.modules_to_not_convert is not None and not all(isinstance(n, str) for n in self.modules_to_not_convert):
            raise ConfigError(f"{self.method}: modules_to_not_convert must be a list of module names")
        self._check_switches()
        self._validate_shared()
        self.validate()

    def _check_switches(self) -> None:
        """Every `bool` option must be a real boolean: "yes" or 1 in a config.json is a mistake, not true."""
        hints = typing.get_type_hints(type(self))
        for name in self.option_names():
            value = getattr(self, name)
            if hints.get(name) is bool and not isinstance(value, bool):
                raise ConfigError(f"{self.method}: {name}={value!r} is not valid; use true or false")

    def _validate_shared(self) -> None:
        if not isinstance(self.solver, str):
            raise ConfigError(f"{self.method}: solver={self.solver!r} is not valid; use a solver name such as 'gptq'")
        if self.solver_options is not None and not isinstance(self.solver_options, dict):
            raise ConfigError(f"{self.method}: solver_options={self.solver_options!r} is not valid; use a JSON object")
        if self.solver != DEFAULT_SOLVER:  # the default needs no look-up (and no plugin scan at import)
            self.solver_object.check_options(self.solver_options or {})
        if not isinstance(self.awq, bool):
            raise ConfigError(f"{self.method}: awq={self.awq!r} is not valid; use true or false")
        for name, low in (("calibration_samples", 1), ("calibration_seq_len", 16)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{self.method}: {name}={value!r} is not valid; use a whole number >= {low}")
        if self.calibration_text is not None and not isinstance(self.calibration_text, str):
            raise ConfigError(f"{self.method}: calibration_text={self.calibration_text!r} must be a file path")
        if self.self_calibration and self.calibration_text is not None:
            raise ConfigError(
                f"{self.method}: self_calibration samples its own text; drop calibration_text or self_calibration"
            )
        if self.target_bits is not None:
            bits = self.target_bits
            if isinstance(bits, bool) or not isinstance(bits, int | float) or not math.isfinite(bits) or bits <= 0:
                raise ConfigError(
                    f"{self.method}: target_bits={bits!r} is not valid; use a positive finite number of bits per "
                    f"weight (such as 3.5)"
                )
            if not self.allocation_candidates():
                raise ConfigError(f"{self.method}: target_bits is not supported; use custom_bits for mixed precision")
        if self.self_calibration and not self.needs_calibration:
            raise ConfigError(
                f"{self.method}: self_calibration makes calibration text, and solver={self.solver!r} uses none; "
                f"add solver='gptq' (or awq / target_bits), or drop self_calibration"
            )
        if self.rotate_inputs is not None and not (
            isinstance(self.rotate_inputs, list | tuple) and all(isinstance(n, str) and n for n in self.rotate_inputs)
        ):
            raise ConfigError(
                f"{self.method}: rotate_inputs={self.rotate_inputs!r} is not valid; use a list of layer names or "
                f"suffixes, such as ['down_proj']"
            )
        check_choice(self.method, "rotation_blocks", self.rotation_blocks, ROTATION_BLOCK_RULES)
        check_choice(self.method, "expert_calibration", self.expert_calibration, EXPERT_CALIBRATIONS)
        self._validate_embedding()
        self._validate_layer_options()

    def _validate_embedding(self) -> None:
        low, high = EMBEDDING_BITS
        bits = self.embedding_bits
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or not low <= bits <= high):
            raise ConfigError(
                f"{self.method}: embedding_bits={bits!r} is not valid; use a whole number from {low} to {high}, "
                f"or None to keep the embedding table in float"
            )
        check_group_size(self.method, "embedding_group_size", self.embedding_group_size, 16, 4096)

    def _validate_layer_options(self) -> None:
        if self.layer_options is None:
            return
        if not isinstance(self.layer_options, dict) or not all(
            isinstance(name, str) and isinstance(options, dict) for name, options in self.layer_options.items()
        ):
            raise ConfigError(f"{self.method}: layer_options must map layer names to objects of options")
        shared = set(QuantlabConfig.option_names())
        for name, options in self.layer_options.items():
            bad = sorted(set(options) & shared | set(options) - set(self.option_names()))
            if bad:
                raise ConfigError(
                    f"{self.method}: layer_options[{name!r}] sets {', '.join(bad)}; a layer may only override "
                    f"the method's own options ({', '.join(sorted(set(self.option_names()) - shared))})"
                )
            self.config_for(name)  # each layer's config must be valid on its own

    def config_for(self, layer: str) -> "QuantlabConfig":
        """The config of one layer: this config with the layer's `layer_options` applied, and
        `input_rotated` set when `rotate_inputs` names the layer."""
        overrides = (self.layer_options or {}).get(layer)
        rotated = self.rotates_input_of(layer)
        if not overrides and not rotated:
            return self
        return self.for_one_layer(**(overrides or {}), input_rotated=rotated)

    def rotates_input_of(self, layer: str) -> bool:
        """Whether `rotate_inputs` names `layer` (matched as `modules_to_not_convert` is: a name, a prefix up to
        a module boundary, a regex, or a suffix)."""
        from transformers.quantizers.quantizers_utils import should_convert_module

        return bool(self.rotate_inputs) and not should_convert_module(layer, list(self.rotate_inputs))

    def for_one_layer(self, **overrides: Any) -> "QuantlabConfig":
        """This config as one layer is quantized with it: the options that act on the whole run
        (`layer_options`, `target_bits`, `self_calibration`) cleared, `overrides` applied."""
        run_level = {"layer_options": None, "target_bits": None, "self_calibration": False}
        return dataclasses.replace(self, **{**run_level, **overrides})

    def allocation_candidates(self) -> list[dict[str, Any]]:
        """Per-layer option sets mixed precision may choose from (none: the method has no mixed precision)."""
        return []

    @property
    def solver_object(self) -> "Solver":
        """The solver `solver` names (`quantlab.solvers`): the one place the name is looked up."""
        return get_solver(self.solver)

    @property
    def needs_calibration(self) -> bool:
        """True when quantizing needs calibration data: a calibrated solver, AWQ, or mixed precision
        (whose allocation weighs each layer's error by its calibration inputs)."""
        if self.awq or self.target_bits is not None:
            return True
        return self.solver != DEFAULT_SOLVER and self.solver_object.needs_calibration

    def validate(self) -> None:
        """Raise `ConfigError` for invalid values; subclasses extend it."""

    # -- serialization -------------------------------------------------------------------

    @classmethod
    def option_names(cls) -> list[str]:
        return [
            field.name
            for field in dataclasses.fields(cls)
            if field.init and not field.metadata.get("resolved_per_layer")
        ]

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        options = {**config_dict, **kwargs}
        quant_method = options.pop("quant_method", None)
        if quant_method not in (None, transformers_name(cls.method)):
            raise ConfigError(f"{cls.__name__} cannot read a config of method {quant_method!r}")
        version = options.pop("format_version", FORMAT_VERSION)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ConfigError(
                f"format_version={version!r} in the quantization config is not a whole number: config.json is "
                f"damaged; restore it, or quantize the float model again"
            )
        if version > FORMAT_VERSION:
            raise ConfigError(
                f"this checkpoint was written with quantlab format version {version}, but the installed "
                f"quantlab reads versions up to {FORMAT_VERSION}: upgrade quantlab (pip install -U quantlab)"
            )
        config = cls.from_options(options)
        return (config, {}) if return_unused_kwargs else config

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "QuantlabConfig":
        """Build a config from a plain dict, naming unknown options and the valid ones."""
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)} for method {cls.method!r}; "
                f"valid options: {', '.join(cls.option_names())}"
            )
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        options = {name: getattr(self, name) for name in self.option_names()}
        if options.get("rotate_inputs") is None:  # unset: a checkpoint earlier releases read as well
            del options["rotate_inputs"]
        if options["rotation_blocks"] == "power_of_two":  # the default: earlier releases read these too
            del options["rotation_blocks"]
        if options["expert_calibration"] == "routed":
            del options["expert_calibration"]
        return {"quant_method": self.quant_method, "format_version": self.format_version, **options}

    def __repr__(self) -> str:
        options = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.option_names())
        return f"{type(self).__name__}({options})"


def check_choice(method: str, option: str, value: Any, choices: Any) -> None:
    if value not in choices:
        raise ConfigError(f"{method}: {option}={value!r} is not valid; choose one of {sorted(choices)!r}")


def check_group_size(method: str, option: str, value: int | None, low: int, high: int) -> None:
    """Group sizes are powers of two in [low, high], or None for one group per output channel."""
    if value is None:
        return
    if not isinstance(value, int) or not low <= value <= high or value & (value - 1):
        raise ConfigError(
            f"{method}: {option}={value!r} is not valid; use a power of two from {low} to {high}, "
            f"or None for one group per output channel"
        )
