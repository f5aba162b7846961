"""quantlab: pluggable weight quantization for PyTorch and Hugging Face transformers."""

from quantlab.config import QuantlabConfig
from quantlab.convert import dequantize, quantize
from quantlab.errors import ConfigError, QuantizationError, QuantlabError, RequantizationWarning, UnknownMethodError
from quantlab.generation import QuantizedKVCache
from quantlab.integrations import peft as _peft_integration  # noqa: F401  (PEFT knows quantlab's layers; no call needed)
from quantlab.integrations import transformers as _transformers_integration
from quantlab.loading import load, load_with_tokenizer
from quantlab.methods.builtin import register_builtin_methods
from quantlab.methods.custom_bits import CustomBitsConfig
from quantlab.methods.int8 import Int8SymmetricConfig
from quantlab.methods.iq4_nl import IQ4NLConfig
from quantlab.methods.lut import LutConfig
from quantlab.methods.nf4 import NF4Config
from quantlab.nn import QuantizedLinear
from quantlab.presets import preset_config
from quantlab.registry import Method, get_method, list_methods, register_method
from quantlab.saving import save_quantized

__version__ = "0.1.0"

_transformers_integration.install()  # transformers hears of every method through the registry
register_builtin_methods()

__all__ = [
    "ConfigError",
    "CustomBitsConfig",
    "IQ4NLConfig",
    "Int8SymmetricConfig",
    "LutConfig",
    "Method",
    "NF4Config",
    "QuantizationError",
    "QuantizedKVCache",
    "QuantizedLinear",
    "QuantlabConfig",
    "QuantlabError",
    "RequantizationWarning",
    "UnknownMethodError",
    "dequantize",
    "get_method",
    "list_methods",
    "load",
    "load_with_tokenizer",
    "preset_config",
    "quantize",
    "register_method",
    "save_quantized",
]
