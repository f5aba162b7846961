"""Command-line flags: those generated from a method's config dataclass, and the arguments commands share.

Every option of a method's config (`config_class.option_names()`) becomes one flag (and every field of
another options dataclass, `add_dataclass_flags`, such as QAT's):
`group_size` → `--group-size`, typed from its annotation. A plugin method gets its flags
without any change here. Flags depend on `--method`, so a command that takes method options
calls `add_method_argument(parser)`; `quantlab.cli.main` reads `--method` from the command
line first and then adds that method's flags with `add_method_options` before parsing for real.

Types: `int`, `float`, `str`; `X | None` also accepts `none` (and `channel`, for group sizes:
one group per output channel); `bool` gives `--flag/--no-flag`; `list[str]` takes a
comma-separated list (an empty string is the empty list); `Literal[...]` and `Enum` give choices;
anything else is read as JSON. A field's `metadata={"help": ...}` becomes the flag's help.
Absent flags are left out, so the config's own defaults apply; invalid values raise the
config's `ConfigError` when the config is built.
"""

import argparse
import dataclasses
import enum
import json
import math
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from quantlab.config import QuantlabConfig
from quantlab.errors import QuantlabError
from quantlab.presets import PRESETS, get_preset, preset_config, preset_names
from quantlab.registry import get_method, list_methods

METHOD_MARKER = "takes_method_options"
_DEST_PREFIX = "method_option."
_NONE_WORDS = ("none", "channel")
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One config field seen as a command-line flag."""

    name: str
    flag: str
    kind: str  # "int", "float", "str", "bool", "list", "choice" or "json"
    optional: bool
    default: Any
    choices: tuple[Any, ...] = ()
    help: str = ""

    @property
    def metavar(self) -> str:
        words = {"int": "INT", "float": "FLOAT", "str": "TEXT", "bool": "BOOL", "list": "A,B,...", "json": "JSON"}
        if self.kind == "choice":
            return "{" + ",".join(_choice_text(choice) for choice in self.choices) + "}"
        return words.get(self.kind, "VALUE")

    @property
    def is_switch(self) -> bool:
        """A plain `bool` field becomes `--flag/--no-flag`; `bool | None` takes a value instead."""
        return self.kind == "bool" and not self.optional

    @property
    def usage(self) -> str:
        """How the flag is written, e.g. `--symmetric/--no-symmetric` or `--bits INT`."""
        if self.is_switch:
            return f"{self.flag}/--no-{self.flag.removeprefix('--')}"
        return f"{self.flag} {self.metavar}" + ("|none" if self.optional else "")

    def parse(self, text: str) -> Any:
        """Turn the flag's text into the field's value; `argparse.ArgumentTypeError` if it cannot."""
        if self.optional and text.strip().lower() in _NONE_WORDS:
            return None
        try:
            return _PARSERS[self.kind](self, text)
        except (ValueError, KeyError, argparse.ArgumentTypeError) as error:
            raise argparse.ArgumentTypeError(f"{self.flag} expects {self.describe_type()}, got {text!r}") from error

    def describe_type(self) -> str:
        described = {
            "int": "a whole number",
            "float": "a finite number",
            "str": "a text",
            "list": "a comma-separated list",
            "json": "a JSON value",
            "bool": "true or false",
            "choice": "one of " + ", ".join(_choice_text(choice) for choice in self.choices),
        }[self.kind]
        return described + (" or 'none'" if self.optional else "")


def _parse_bool(spec: OptionSpec, text: str) -> bool:
    words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    return words[text.strip().lower()]


def _choice_text(choice: Any) -> str:
    return str(choice.value if isinstance(choice, enum.Enum) else choice)


def _parse_choice(spec: OptionSpec, text: str) -> Any:
    for choice in spec.choices:
        if text == _choice_text(choice):
            return choice
    raise ValueError(text)


def finite_float(text: str) -> float:
    """A flag's number; NaN and infinities are refused at parse time, before any work (argparse's `type=`)."""
    number = float(text)
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"expects a finite number, got {text!r}")
    return number


_PARSERS: dict[str, Callable[[OptionSpec, str], Any]] = {
    "int": lambda spec, text: int(text),
    "float": lambda spec, text: finite_float(text),
    "str": lambda spec, text: text,
    "bool": _parse_bool,
    "list": lambda spec, text: [item.strip() for item in text.split(",") if item.strip()],
    "choice": _parse_choice,
    "json": lambda spec, text: json.loads(text),
}


def option_specs(config_class: type[QuantlabConfig]) -> list[OptionSpec]:
    """The flags of every option of `config_class`: the method's own first, then those all methods share."""
    shared = set(QuantlabConfig.option_names())
    names = config_class.option_names()
    return field_specs(config_class, [name for name in names if name not in shared] + [n for n in names if n in shared])


def field_specs(dataclass: type, names: Sequence[str] | None = None) -> list[OptionSpec]:
    """The flags of the fields `names` (default: every field) of a dataclass, in that order."""
    hints = _type_hints(dataclass)
    fields = {field.name: field for field in dataclasses.fields(dataclass)}
    specs = []
    for name in names if names is not None else list(fields):
        field = fields[name]
        kind, optional, choices = _classify(hints.get(name, field.type))
        specs.append(
            OptionSpec(
                name=name,
                flag="--" + name.replace("_", "-"),
                kind=kind,
                optional=optional,
                default=_default_of(field),
                choices=choices,
                help=str(field.metadata.get("help", "")),
            )
        )
    return specs


def _type_hints(config_class: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(config_class)
    except (NameError, TypeError):  # an annotation that cannot be resolved: fall back to the raw ones
        return {}


def _classify(annotation: Any) -> tuple[str, bool, tuple[Any, ...]]:
    """(kind, accepts None, choices) of a field annotation."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        if len(members) != 1:
            return "json", optional, ()
        annotation = members[0]
        origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "choice", optional, tuple(typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "choice", optional, tuple(annotation)
    if origin in (list, tuple, Sequence) and typing.get_args(annotation)[:1] == (str,):
        return "list", optional, ()
    simple = {bool: "bool", int: "int", float: "float", str: "str"}
    return simple.get(annotation, "json"), optional, ()


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


# -- argparse -------------------------------------------------------------------------------


def add_method_argument(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """Add `--method NAME`; `quantlab.cli.main` then adds the chosen method's own flags."""
    parser.add_argument(
        "--method",
        required=required,
        metavar="NAME",
        help="quantization method (see 'quantlab methods'); its options, e.g. --bits or --group-size, "
        "are listed by 'quantlab <command> --method NAME --help'",
    )
    parser.set_defaults(**{METHOD_MARKER: True})


def add_preset_argument(parser: argparse.ArgumentParser) -> None:
    """Add `--preset NAME` (`quantlab.presets`): a method and options; flags given beside it override them."""
    described = "; ".join(f"{name}: {PRESETS[name].description}" for name in preset_names())
    parser.add_argument(
        "--preset",
        choices=preset_names(),
        metavar="NAME",
        help=f"settings that export to GGUF exactly, instead of --method (other flags override them): {described}",
    )


def method_from_argv(argv: Sequence[str]) -> str | None:
    """The value of `--method` in `argv`, else the method of its `--preset`, read without needing the rest valid."""
    scanner = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    scanner.add_argument("--method")
    scanner.add_argument("--preset")
    known, _ = scanner.parse_known_args(list(argv))
    if known.method is None and known.preset in PRESETS:
        return get_preset(known.preset).method
    return known.method


def add_method_options(parser: argparse.ArgumentParser, method_name: str) -> None:
    """Add one flag per option of the registered method `method_name` to `parser`."""
    method = get_method(method_name)
    group = parser.add_argument_group(f"{method.name} options", method.description)
    for spec in option_specs(method.config_class):
        try:
            _add_flag(group, spec)
        except argparse.ArgumentError as error:
            raise QuantlabError(
                f"method {method.name!r}: its option {spec.name!r} clashes with the command's own {spec.flag} "
                f"flag; the method's author must rename the config field"
            ) from error


def add_dataclass_flags(group: argparse._ArgumentGroup, dataclass: type, prefix: str) -> None:
    """One flag per field of `dataclass` (typed and documented by the field), its value kept under `prefix`;
    `dataclass_from_args` builds the instance from the flags given, the dataclass's defaults for the rest."""
    for spec in field_specs(dataclass):
        _add_flag(group, spec, prefix)


def dataclass_from_args(dataclass: type[T], args: argparse.Namespace, prefix: str) -> T:
    """The `dataclass` built from the flags `add_dataclass_flags` added under `prefix` that were given."""
    given = {name.removeprefix(prefix): value for name, value in vars(args).items() if name.startswith(prefix)}
    return dataclass(**given)


def _add_flag(group: argparse._ArgumentGroup, spec: OptionSpec, prefix: str = _DEST_PREFIX) -> None:
    shown_default = "none" if spec.default is None else spec.default
    if isinstance(shown_default, list):
        shown_default = ",".join(shown_default) or "''"
    text = f"{spec.help or spec.describe_type()} (default: {shown_default})"
    dest = prefix + spec.name
    if spec.is_switch:
        group.add_argument(
            spec.flag, action=argparse.BooleanOptionalAction, dest=dest, default=argparse.SUPPRESS, help=text
        )
    else:
        group.add_argument(
            spec.flag,
            type=spec.parse,
            dest=dest,
            default=argparse.SUPPRESS,
            metavar=spec.metavar + ("|none" if spec.optional else ""),
            help=text,
        )


def config_from_args(args: argparse.Namespace) -> QuantlabConfig:
    """The chosen method's config (or preset's, `--preset`) from the flags given; `ConfigError` names any
    invalid value."""
    given = {
        name.removeprefix(_DEST_PREFIX): value for name, value in vars(args).items() if name.startswith(_DEST_PREFIX)
    }
    preset = getattr(args, "preset", None)
    if preset is not None:
        return preset_config(preset, args.method, **given)
    if args.method is None:
        raise QuantlabError(
            "choose a method with --method NAME (see 'quantlab methods') or a preset with --preset NAME"
        )
    return get_method(args.method).config_class.from_options(given)


def explain_unrecognized(extras: Sequence[str], method_name: str | None) -> str:
    """A message for flags argparse did not know, naming the method they belong to if any."""
    flags = [extra.split("=", 1)[0] for extra in extras if extra.startswith("--")]
    if method_name is None or not flags:
        return f"unrecognized arguments: {' '.join(extras)}"
    owners = {}
    for name in list_methods():
        for spec in option_specs(get_method(name).config_class):
            owners.setdefault(spec.flag, []).append(name)
            if spec.is_switch:
                owners.setdefault("--no-" + spec.flag.removeprefix("--"), []).append(name)
    own = ", ".join(spec.usage for spec in option_specs(get_method(method_name).config_class))
    unknown = flags[0]
    where = f" ({unknown} is an option of {', '.join(owners[unknown])})" if unknown in owners else ""
    return f"{unknown} is not an option of method {method_name!r}{where}; its options: {own}"


# -- the arguments several commands share ---------------------------------------------------------

MODEL_HELP = "a Hugging Face model folder or a .gguf file (default: the embedded SmolLM2-135M-Instruct)"


def add_model_argument(parser: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    """The optional MODEL positional that `quantlab.loading.resolve_model` reads (absent: the embedded default)."""
    parser.add_argument("model", nargs="?", metavar="MODEL", help=help)


def add_output_dir_arguments(
    parser: argparse.ArgumentParser, help: str = "folder to write the checkpoint to", required: bool = True
) -> None:
    """`--output/-o DIR` (required unless `required` is false) and `--overwrite`; `help` says what goes into DIR."""
    parser.add_argument("--output", "-o", required=required, metavar="DIR", help=help)
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
