"""PEFT integration: LoRA on every quantlab method, with no call needed from the user.

PEFT wraps only layer types it knows (`get_peft_model` raises "Target module ... is not
supported" otherwise). Its hook for other layers, `LoraConfig._register_custom_module`, is
per config instance, so quantlab wraps `LoraConfig.__post_init__`: every `LoraConfig` built
in the process, including the one `PeftModel.from_pretrained` reads back from
`adapter_config.json`, maps `QuantizedLinear` (any method, plugins too) to
`QuantizedLoraLinear`. Saved adapters therefore reload wherever quantlab is imported.

`install()` is cheap: it patches PEFT at once if PEFT is already loaded, and otherwise puts a
finder on `sys.meta_path` that patches `peft.tuners.lora.config` right after it is first
imported, so `import quantlab` never imports PEFT. Set `QUANTLAB_PEFT=0` to leave PEFT alone.
"""

import functools
import os
import sys
import warnings
from importlib.machinery import PathFinder
from types import ModuleType
from typing import Any

_LORA_CONFIG_MODULE = "peft.tuners.lora.config"
_PATCHED = "_quantlab_registers_lora_layers"


def install() -> None:
    """Register quantlab's LoRA layer with PEFT now if PEFT is loaded, else when it loads."""
    if os.environ.get("QUANTLAB_PEFT", "1") == "0":
        return
    module = sys.modules.get(_LORA_CONFIG_MODULE)
    if module is not None and hasattr(module, "LoraConfig"):
        patch_lora_config(module.LoraConfig)
    elif not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())


def register_with_peft() -> None:
    """Import PEFT and register quantlab's LoRA layer with it (idempotent)."""
    from peft.tuners.lora.config import LoraConfig

    patch_lora_config(LoraConfig)


def lora_layer_mapping() -> dict[type, type]:
    """The custom-module mapping every `LoraConfig` receives: quantized layer → LoRA layer."""
    from quantlab.integrations.peft_lora import QuantizedLoraLinear
    from quantlab.nn import QuantizedLinear

    return {QuantizedLinear: QuantizedLoraLinear}


def patch_lora_config(lora_config_class: type) -> None:
    """Make `lora_config_class.__post_init__` register quantlab's LoRA layer on each instance."""
    original = lora_config_class.__post_init__
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        original(self)
        self._register_custom_module(lora_layer_mapping())

    setattr(__post_init__, _PATCHED, True)
    lora_config_class.__post_init__ = __post_init__


class _PatchAfterImport:
    """A meta-path finder that patches `LoraConfig` once its module has executed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _LORA_CONFIG_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            try:
                patch_lora_config(module.LoraConfig)
            except Exception as error:  # PEFT changed shape: LoRA on quantlab layers is off, PEFT still works
                warnings.warn(f"quantlab could not register its LoRA layers with PEFT: {error}", stacklevel=2)

        spec.loader.exec_module = exec_then_patch
        return spec


install()
