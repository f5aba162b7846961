"""Wrapping a function of another library in place, once, keeping the original reachable.

Used only where PEFT or transformers offer no public hook (the README lists each one). A
wrapper always calls the original and only adds to its result, so models without quantlab
layers behave exactly as before.
"""

import functools
import sys
from collections.abc import Callable
from typing import Any

ORIGINAL = "__quantlab_original__"


def wrap(owner: Any, name: str, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Set `owner.name` to `make_wrapper(original)`, unless quantlab wrapped it already.

    `owner` is a module or a class; on a class the wrapper shadows an inherited method for that
    class (and its subclasses) only. Modules that imported the function by name (`from m import f`)
    before the wrap get the wrapper too.
    """
    original = getattr(owner, name)
    if hasattr(original, ORIGINAL):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, ORIGINAL, original)
    setattr(owner, name, wrapper)
    if not isinstance(owner, type):
        _rebind_imported(original, wrapper, owner.__name__.partition(".")[0])


def _rebind_imported(original: Callable[..., Any], wrapper: Callable[..., Any], package: str) -> None:
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == package or module_name.startswith(package + ".")):
            continue
        for attribute, value in list(vars(module).items()):
            if value is original:
                setattr(module, attribute, wrapper)
