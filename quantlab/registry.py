"""The method registry: one name binds a config class and a quantized module (which declares its storage layout).

The registry builds nothing for other libraries: integrations subscribe to it (`subscribe`)
and hear of every method registered, before or after they subscribed. The transformers
integration (`quantlab.integrations.transformers`) registers each method's config and an
`HfQuantizer` with transformers that way, so `from_pretrained(..., quantization_config=config)`
and reloading a saved checkpoint work. Outside packages add methods through the entry-point
group `quantlab.methods`: each entry point, named after the method it registers, names a
callable that calls `register_method` (or a module that does so on import). They are imported
on the first look-up or the first load of a checkpoint that uses them, not when `quantlab` is
imported.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

from quantlab.config import QuantlabConfig
from quantlab.errors import UnknownMethodError
from quantlab.nn import QuantizedLinear
from quantlab.utils.entry_points import load_entry_points

ENTRY_POINT_GROUP = "quantlab.methods"
_NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class Method:
    name: str
    config_class: type[QuantlabConfig]
    module_class: type[QuantizedLinear]
    description: str
    source: str
    quantizer_class: type | None = None  # the method's own HfQuantizer; None: the integration makes one


Subscriber = Callable[[Method], None]

_METHODS: dict[str, Method] = {}
_SUBSCRIBERS: list[Subscriber] = []
_plugins_discovered = False


def subscribe(subscriber: Subscriber) -> None:
    """Call `subscriber(method)` for every method registered so far and every one registered later."""
    if subscriber in _SUBSCRIBERS:
        return
    _SUBSCRIBERS.append(subscriber)
    for method in list(_METHODS.values()):
        subscriber(method)


def register_method(
    config_class: type[QuantlabConfig],
    module_class: type[QuantizedLinear],
    *,
    description: str | None = None,
    quantizer_class: type | None = None,
    source: str = "quantlab",
) -> Method:
    """Add a method under `config_class.method`; a second, different method of that name raises.

    `quantizer_class`: the method's own `HfQuantizer`, if it needs one; otherwise the transformers
    integration makes a `QuantlabHfQuantizer` subclass for the module. Registering the very same
    classes again returns the existing method. Subscribers hear of the new method before it returns.
    """
    name = config_class.method
    if not _NAME_PATTERN.match(name):
        raise ValueError(f"method name {name!r} must be lowercase letters, digits and underscores")
    existing = _METHODS.get(name)
    if existing is not None:
        if existing.config_class is config_class and existing.module_class is module_class:
            return existing
        raise ValueError(
            f"a quantization method named {name!r} is already registered (by {existing.source}); choose another name"
        )
    doc = (config_class.__doc__ or "").strip().splitlines()
    method = Method(
        name=name,
        config_class=config_class,
        module_class=module_class,
        description=description or (doc[0] if doc else name),
        source=source,
        quantizer_class=quantizer_class,
    )
    _METHODS[name] = method
    for subscriber in list(_SUBSCRIBERS):
        subscriber(method)
    return method


def get_method(name: str) -> Method:
    """The method registered under `name`; an unknown name raises and lists the known ones."""
    discover_plugins()
    method = _METHODS.get(name)
    if method is None:
        raise UnknownMethodError(f"unknown quantization method {name!r}; known methods: {', '.join(list_methods())}")
    return method


def list_methods() -> list[str]:
    """Names of every registered method, built-in and plugin, sorted."""
    discover_plugins()
    return sorted(_METHODS)


def method_of(config: QuantlabConfig) -> Method:
    return get_method(config.method)


def pending_plugin_methods() -> list[str]:
    """Names of the installed plugins' methods not loaded yet (one scan of the entry points; no plugin code runs)."""
    if _plugins_discovered:
        return []
    installed = [entry_point.name for entry_point in entry_points(group=ENTRY_POINT_GROUP)]
    return [name for name in installed if name not in _METHODS]


def discover_plugins() -> None:
    """Load every `quantlab.methods` entry point once. A broken plugin warns, it does not break quantlab."""
    global _plugins_discovered
    if _plugins_discovered:
        return
    _plugins_discovered = True
    load_entry_points(ENTRY_POINT_GROUP, "plugin")
