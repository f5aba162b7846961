"""Run a callback once a module has been imported, without importing it.

quantlab adapts PEFT and transformers where they offer no public hook (see
`quantlab.integrations.peft`), but must not import them itself: `after_import` runs the
callback at once when the module is loaded, and otherwise right after the module's code has
executed, through one finder on `sys.meta_path` that removes itself when nothing is left to wait for.
A module caught halfway through its own import (quantlab imported from inside it) is
handled at the next import of any module, by which time it has usually finished.
"""

import sys
import warnings
from collections.abc import Callable
from importlib.machinery import PathFinder
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]

# module name -> [(attribute that shows the module is ready, callback)]
_PENDING: dict[str, list[tuple[str, Callback]]] = {}


def after_import(module_name: str, ready_attribute: str, callback: Callback) -> None:
    """Call `callback(module)` once `module_name` is imported and defines `ready_attribute`."""
    module = sys.modules.get(module_name)
    if module is not None and hasattr(module, ready_attribute):
        _run(callback, module)
        return
    _PENDING.setdefault(module_name, []).append((ready_attribute, callback))
    if not any(isinstance(finder, _RunAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RunAfterImport())


def _run(callback: Callback, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as error:  # the library changed shape: that adaptation is off, the library still works
        warnings.warn(f"quantlab could not adapt {module.__name__}: {error}", stacklevel=3)


def _run_ready() -> None:
    for name in list(_PENDING):
        module = sys.modules.get(name)
        if module is None:
            continue
        waiting = _PENDING.pop(name, None) or []
        still = [(attribute, callback) for attribute, callback in waiting if not hasattr(module, attribute)]
        for attribute, callback in waiting:
            if hasattr(module, attribute):
                _run(callback, module)
        if still:
            _PENDING.setdefault(name, []).extend(still)


def _uninstall_when_done() -> None:
    if not _PENDING:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _RunAfterImport)]


class _RunAfterImport:
    """Wraps the loader of each awaited module so its callbacks run right after it executes."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        _run_ready()
        if name not in _PENDING:
            _uninstall_when_done()
            return None
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_run(module: ModuleType) -> None:
            exec_module(module)
            _run_ready()
            _uninstall_when_done()

        spec.loader.exec_module = exec_then_run
        return spec
