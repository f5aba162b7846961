"""`after_import`: a callback runs once its module has executed, never importing the module itself."""

import sys
import uuid

import pytest

from quantlab.utils.import_hooks import after_import


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh package on sys.path: `<name>.target` defines READY, `<name>.other` nothing."""
    name = f"hooked_{uuid.uuid4().hex[:8]}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "target.py").write_text("READY = 1\n")
    (root / "other.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def test_callback_waits_for_the_module_and_runs_once(package):
    seen = []
    after_import(f"{package}.target", "READY", lambda module: seen.append(module.READY))
    assert seen == [] and f"{package}.target" not in sys.modules
    __import__(f"{package}.target")
    assert seen == [1]
    __import__(f"{package}.other")
    assert seen == [1]


def test_callback_runs_at_once_when_the_module_is_loaded(package):
    __import__(f"{package}.target")
    seen = []
    after_import(f"{package}.target", "READY", lambda module: seen.append(module.__name__))
    assert seen == [f"{package}.target"]


def test_a_module_caught_mid_import_is_handled_when_it_defines_the_attribute(package):
    """As when quantlab is imported from inside PEFT's own import: the callback waits for the attribute."""
    seen = []
    __import__(package)
    sys.modules[f"{package}.outer"] = type(sys)(f"{package}.outer")  # loaded, attribute not defined yet
    after_import(f"{package}.outer", "READY", lambda module: seen.append(module.READY))
    assert seen == []
    sys.modules[f"{package}.outer"].READY = 2
    __import__(f"{package}.other")  # any later import lets the finder look again
    assert seen == [2]


def test_a_failing_callback_warns_instead_of_breaking_the_import(package):
    def broken(module):
        raise AttributeError("no such function")

    after_import(f"{package}.target", "READY", broken)
    with pytest.warns(UserWarning, match=rf"could not adapt {package}.target: no such function"):
        module = __import__(f"{package}.target", fromlist=["READY"])
    assert module.READY == 1
