"""`quantlab methods`: every registered method, built-in or plugin, with its options and defaults."""

import argparse
from typing import Any

from quantlab.cli.console import Console, add_output_options
from quantlab.cli.options import OptionSpec, option_specs
from quantlab.registry import Method, get_method, list_methods


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "methods",
        help="list the quantization methods, built-in and plugins, with their options",
        description="Every registered quantization method (plugins included, from the 'quantlab.methods' entry "
        "points) with its command-line options and their defaults.",
    )
    add_output_options(parser)


def run(args: argparse.Namespace) -> int:
    methods = [get_method(name) for name in list_methods()]
    Console.from_args(args).report(
        "\n\n".join(_describe(method) for method in methods),
        {"command": "methods", "methods": [_as_dict(method) for method in methods]},
    )
    return 0


def _describe(method: Method) -> str:
    lines = [f"{method.name}  ({method.source})", f"  {method.description}"]
    specs = option_specs(method.config_class)
    width = max((len(spec.usage) for spec in specs), default=0)
    lines += [f"    {spec.usage:<{width}}  default {_shown(spec.default)}" for spec in specs]
    return "\n".join(lines)


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return ",".join(value) or "''"
    return str(value)


def _as_dict(method: Method) -> dict[str, Any]:
    return {
        "name": method.name,
        "description": method.description,
        "source": method.source,
        "config_class": f"{method.config_class.__module__}.{method.config_class.__qualname__}",
        "options": [_option_dict(spec) for spec in option_specs(method.config_class)],
    }


def _option_dict(spec: OptionSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "flag": spec.flag,
        "type": spec.kind,
        "accepts_none": spec.optional,
        "default": spec.default,
        "choices": [str(choice) for choice in spec.choices],
        "help": spec.help,
    }
