"""The Python codec registry is the source of truth: the C sources decode exactly its native codecs.

`quantlab_cpu.h` numbers the kinds of `ql_weight` (QL_AFFINE, ...) and `torch_ops.cpp`'s `parse_layout`
maps a descriptor's codec name to one; both must agree with `Codec.native_kind` of every registered
codec that has one, or a layer would be decoded as another format.
"""

import re
from pathlib import Path

import quantlab.kernels.cpu
from quantlab.formats.codec import native_codecs

CSRC = Path(quantlab.kernels.cpu.__file__).parent / "csrc"


def _kind_enum() -> dict[str, int]:
    """QL_<NAME> -> value of the enum holding QL_AFFINE in quantlab_cpu.h."""
    header = (CSRC / "quantlab_cpu.h").read_text()
    body = re.search(r"enum\s*\{([^}]*\bQL_AFFINE\b[^}]*)\}", header).group(1)
    return {name: int(value) for name, value in re.findall(r"(QL_\w+)\s*=\s*(\d+)", body)}


def _parse_layout_names() -> dict[str, str]:
    """Codec name -> QL_<NAME> as `parse_layout` in torch_ops.cpp maps them."""
    source = (CSRC / "torch_ops.cpp").read_text()
    function = source[source.index("Layout parse_layout(") :]
    function = function[: function.index("\n}\n")]
    return dict(re.findall(r'token == "(\w+)" \? (QL_\w+)', function))


def test_the_c_kind_enum_numbers_the_native_codecs_as_the_registry_does():
    enum = _kind_enum()
    assert {f"QL_{name.upper()}": kind for name, kind in native_codecs().items()} == enum


def test_parse_layout_reads_exactly_the_native_codecs_names():
    enum, names = _kind_enum(), _parse_layout_names()
    assert set(names) == set(native_codecs())
    assert {name: enum[constant] for name, constant in names.items()} == native_codecs()


def test_the_operators_error_messages_name_python_that_exists():
    """A user-facing message naming a Python function (`quantlab.x.y`) must name one that exists."""
    import importlib

    for source in CSRC.glob("*.cpp"):
        for dotted in re.findall(r'"[^"\n]*?\b(quantlab(?:\.\w+)+)', source.read_text()):
            module_name, _, attribute = dotted.rpartition(".")
            try:
                owner = importlib.import_module(module_name)
            except ModuleNotFoundError:
                owner = importlib.import_module(module_name.rpartition(".")[0])
                owner = getattr(owner, module_name.rpartition(".")[2])
            assert hasattr(owner, attribute), f"{source.name} names {dotted}, which does not exist"
