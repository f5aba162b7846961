"""Registers quantlab's methods with transformers in processes that never import quantlab.

transformers only knows the quantization methods registered in the running process; loading
a quantlab checkpoint anywhere else would (without this hook) run its integer codes as float
weights. `quantlab_autoload.pth`, installed beside this file, imports it at interpreter start.
It costs one entry on `sys.meta_path` and imports nothing heavy: quantlab itself is imported
only right after `transformers.modeling_utils` finishes loading, i.e. only in processes that
are about to build a transformers model (`import peft` is one of them). Importing quantlab
also adapts PEFT to its layers (`quantlab.integrations.peft`), so the QLoRA recipe runs on a
quantlab checkpoint without `import quantlab`. Set `QUANTLAB_AUTOLOAD=0` to turn it off.
"""

import os
import sys
import warnings
from importlib.machinery import PathFinder

_TRIGGER = "transformers.modeling_utils"


class _ImportQuantlabAfterTransformers:
    """A meta-path finder that wraps the loader of `_TRIGGER` to import quantlab after it."""

    def find_spec(self, name, path=None, target=None):
        if name != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                import quantlab  # noqa: F401  (registers built-in and plugin methods)
            except Exception as error:
                warnings.warn(f"quantlab could not register its methods with transformers: {error}", stacklevel=2)

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    if os.environ.get("QUANTLAB_AUTOLOAD", "1") == "0" or _TRIGGER in sys.modules:
        return
    if not any(isinstance(finder, _ImportQuantlabAfterTransformers) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ImportQuantlabAfterTransformers())


install()
