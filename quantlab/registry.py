"""The method registry: one name binds a config class, an `HfQuantizer` and a quantized module.

Registering a method also registers its config and quantizer with transformers, so
`from_pretrained(..., quantization_config=config)` and reloading a saved checkpoint work.
Outside packages add methods through the entry-point group `quantlab.methods`: each entry
point, named after the method it registers, names a callable that calls `register_method`
(or a module that does so on import). They are imported on the first look-up or the first
load of a checkpoint that uses them, not when `quantlab` is imported.
"""

import re
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
    quantizer_class: type
    description: str
    source: str


_METHODS: dict[str, Method] = {}
_plugins_discovered = False


def register_method(
    config_class: type[QuantlabConfig],
    module_class: type[QuantizedLinear],
    *,
    description: str | None = None,
    quantizer_class: type | None = None,
    source: str = "quantlab",
) -> Method:
    """Add a method under `config_class.method`; a second, different method of that name raises.

    Without `quantizer_class`, a `QuantlabHfQuantizer` subclass is made for the module.
    Registering the very same classes again returns the existing method.
    """
    from quantlab.integrations.transformers import make_quantizer_class, register_with_transformers

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
    quantizer_class = quantizer_class or make_quantizer_class(module_class)
    register_with_transformers(config_class, quantizer_class)
    doc = (config_class.__doc__ or "").strip().splitlines()
    method = Method(
        name=name,
        config_class=config_class,
        module_class=module_class,
        quantizer_class=quantizer_class,
        description=description or (doc[0] if doc else name),
        source=source,
    )
    _METHODS[name] = method
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


def reserve_plugin_methods() -> None:
    """Let transformers read checkpoints of installed plugins before the plugins are imported.

    Costs one scan of the installed packages' entry points; no plugin code runs.
    """
    from quantlab.integrations.transformers import reserve_plugin_names

    if not _plugins_discovered:
        reserve_plugin_names([entry_point.name for entry_point in entry_points(group=ENTRY_POINT_GROUP)])


def discover_plugins() -> None:
    """Load every `quantlab.methods` entry point once. A broken plugin warns, it does not break quantlab."""
    global _plugins_discovered
    if _plugins_discovered:
        return
    _plugins_discovered = True
    load_entry_points(ENTRY_POINT_GROUP, "plugin")
