"""Flags generated from config dataclasses: types, parsing, defaults, and errors (in-process)."""

import argparse
import dataclasses
import enum
from typing import Literal

import pytest

from quantlab import ConfigError, CustomBitsConfig, Int8SymmetricConfig, NF4Config, QuantlabConfig, UnknownMethodError
from quantlab.cli import options
from quantlab.cli.main import main, parse


class Speed(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


@dataclasses.dataclass(repr=False)
class EveryTypeConfig(QuantlabConfig):
    """A config with one field of each kind the CLI understands (not registered)."""

    method = "every_type"

    count: int = 3
    ratio: float | None = 0.5
    label: str = "x"
    enabled: bool = True
    maybe: bool | None = None
    layers: list[str] = dataclasses.field(default_factory=list)
    mode: Literal["a", "b"] = "a"
    speed: Speed = Speed.FAST
    table: dict[str, int] = dataclasses.field(default_factory=dict, metadata={"help": "a mapping"})


def specs_of(config_class: type) -> dict[str, options.OptionSpec]:
    return {spec.name: spec for spec in options.option_specs(config_class)}


def test_flags_follow_the_config_fields_of_every_builtin() -> None:
    for config_class in (Int8SymmetricConfig, NF4Config, CustomBitsConfig):
        assert sorted(specs_of(config_class)) == sorted(config_class.option_names())
    flags = [spec.flag for spec in options.option_specs(CustomBitsConfig)]
    # The method's own options first, the shared ones after.
    shared = ["--modules-to-not-convert", "--solver", "--solver-options", "--awq"]
    shared += [
        "--calibration-text",
        "--self-calibration",
        "--calibration-samples",
        "--calibration-seq-len",
        "--target-bits",
        "--layer-options",
        "--rotate-inputs",
        "--rotation-blocks",
        "--expert-calibration",
        "--embedding-bits",
        "--embedding-group-size",
    ]
    assert flags == ["--bits", "--group-size", "--symmetric", "--scale-dtype", *shared]


def test_kinds_and_defaults_come_from_annotations() -> None:
    specs = specs_of(EveryTypeConfig)
    kinds = {name: (spec.kind, spec.optional) for name, spec in specs.items()}
    assert kinds == {
        "count": ("int", False),
        "ratio": ("float", True),
        "label": ("str", False),
        "enabled": ("bool", False),
        "maybe": ("bool", True),
        "layers": ("list", False),
        "mode": ("choice", False),
        "speed": ("choice", False),
        "table": ("json", False),
        "modules_to_not_convert": ("list", True),
        "solver": ("str", False),
        "solver_options": ("json", True),
        "awq": ("bool", False),
        "calibration_text": ("str", True),
        "self_calibration": ("bool", False),
        "calibration_samples": ("int", False),
        "calibration_seq_len": ("int", False),
        "target_bits": ("float", True),
        "layer_options": ("json", True),
        "rotate_inputs": ("list", True),
        "rotation_blocks": ("choice", False),
        "expert_calibration": ("choice", False),
        "embedding_bits": ("int", True),
        "embedding_group_size": ("int", True),
    }
    assert specs["count"].default == 3
    assert specs["layers"].default == []
    assert specs["table"].help == "a mapping"
    assert specs["enabled"].usage == "--enabled/--no-enabled"
    assert specs["maybe"].usage == "--maybe BOOL|none"


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("count", "7", 7),
        ("ratio", "none", None),
        ("ratio", "0.25", 0.25),
        ("maybe", "yes", True),
        ("maybe", "None", None),
        ("layers", "lm_head, model.layers.0.mlp", ["lm_head", "model.layers.0.mlp"]),
        ("layers", "", []),
        ("mode", "b", "b"),
        ("speed", "exact", Speed.EXACT),
        ("table", '{"a": 1}', {"a": 1}),
    ],
)
def test_parse_turns_text_into_field_values(name: str, text: str, value: object) -> None:
    assert specs_of(EveryTypeConfig)[name].parse(text) == value


def test_group_size_accepts_channel_for_per_channel() -> None:
    assert specs_of(CustomBitsConfig)["group_size"].parse("channel") is None


@pytest.mark.parametrize(("name", "text"), [("count", "three"), ("mode", "c"), ("maybe", "perhaps"), ("table", "{")])
def test_parse_rejects_text_of_the_wrong_type(name: str, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=specs_of(EveryTypeConfig)[name].flag):
        specs_of(EveryTypeConfig)[name].parse(text)


def test_parsed_flags_build_the_config_and_absent_flags_keep_its_defaults() -> None:
    args = parse(["quantize", "--method", "custom_bits", "--bits", "3", "--no-symmetric", "--output", "x"])
    config = options.config_from_args(args)
    assert config == CustomBitsConfig(bits=3, symmetric=False)
    args = parse(["quantize", "--method", "int8", "--group-size", "channel", "--output", "x"])
    assert options.config_from_args(args) == Int8SymmetricConfig(group_size=None)
    args = parse(["quantize", "--method", "nf4", "--modules-to-not-convert", "lm_head,mlp", "--output", "x"])
    assert options.config_from_args(args).modules_to_not_convert == ["lm_head", "mlp"]


def test_invalid_values_raise_the_configs_own_error() -> None:
    args = parse(["quantize", "--method", "custom_bits", "--bits", "9", "--output", "x"])
    with pytest.raises(ConfigError, match="bits=9 is not valid"):
        options.config_from_args(args)


def test_unknown_method_lists_the_known_ones() -> None:
    with pytest.raises(UnknownMethodError, match=r"known methods: .*custom_bits.*int8.*nf4"):
        parse(["quantize", "--method", "nope", "--output", "x"])


def test_another_methods_flag_is_named_with_its_owner() -> None:
    message = options.explain_unrecognized(["--bits", "3"], "nf4")
    assert message.startswith("--bits is not an option of method 'nf4' (--bits is an option of ")
    assert "custom_bits" in message.split(")")[0]  # plugins may offer --bits too
    assert "--blocksize INT" in message


def test_a_field_that_clashes_with_a_command_flag_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass(repr=False)
    class ClashConfig(QuantlabConfig):
        method = "clash"
        output: str = "x"

    class FakeMethod:
        name, config_class, description = "clash", ClashConfig, "clashes"

    monkeypatch.setattr(options, "get_method", lambda name: FakeMethod)
    parser = argparse.ArgumentParser()
    parser.add_argument("--output")
    with pytest.raises(options.QuantlabError, match="clashes with the command's own --output"):
        options.add_method_options(parser, "clash")


def test_method_help_lists_that_methods_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", "--method", "custom_bits", "--help"]) == 0
    shown = capsys.readouterr().out
    assert "custom_bits options" in shown
    assert "--group-size INT|none" in shown
    assert "--symmetric, --no-symmetric" in shown


@dataclasses.dataclass(frozen=True)
class _ToyOptions:
    mode: Literal["a", "b"] = dataclasses.field(default="a", metadata={"help": "which mode"})
    bound: float | None = None
    switch: bool = True


def test_an_options_dataclass_gives_its_flags_and_defaults() -> None:
    parser = argparse.ArgumentParser()
    options.add_dataclass_flags(parser.add_argument_group("toy"), _ToyOptions, "toy.")
    assert options.dataclass_from_args(_ToyOptions, parser.parse_args([]), "toy.") == _ToyOptions()
    given = parser.parse_args(["--mode", "b", "--bound", "none", "--no-switch"])
    assert options.dataclass_from_args(_ToyOptions, given, "toy.") == _ToyOptions("b", None, False)
    assert "which mode (default: a)" in " ".join(parser.format_help().split())
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])


def test_qat_takes_every_qat_option_as_a_flag_with_its_default() -> None:
    from quantlab.qat import QATOptions

    command = ["qat", "--max-steps", "1", "-o", "out"]
    assert options.dataclass_from_args(QATOptions, parse(command), "qat_option.") == QATOptions()
    given = parse([*command, "--train", "weights", "--no-learn-scales", "--max-offset", "0.5", "--norm-lr-ratio", "1"])
    expected = QATOptions(train="weights", learn_scales=False, max_offset=0.5, norm_lr_ratio=1.0)
    assert options.dataclass_from_args(QATOptions, given, "qat_option.") == expected
