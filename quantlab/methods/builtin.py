"""Registers the built-in methods."""

from quantlab.methods.custom_bits import CustomBitsConfig, CustomBitsLinear
from quantlab.methods.int8 import Int8Linear, Int8SymmetricConfig
from quantlab.methods.iq4_nl import IQ4NLConfig, IQ4NLLinear
from quantlab.methods.lut import LutConfig, LutLinear
from quantlab.methods.nf4 import NF4Config, NF4Linear
from quantlab.registry import register_method


def register_builtin_methods() -> None:
    register_method(Int8SymmetricConfig, Int8Linear)
    register_method(NF4Config, NF4Linear)
    register_method(CustomBitsConfig, CustomBitsLinear)
    register_method(IQ4NLConfig, IQ4NLLinear)
    register_method(LutConfig, LutLinear)
