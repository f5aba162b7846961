"""The method contract on every built-in method, across widths and layouts."""

from quantlab import CustomBitsConfig, Int8SymmetricConfig, IQ4NLConfig, LutConfig, NF4Config
from quantlab.testing.contract import MethodContract

# Floors measured on N(0, 0.02) weights, less about 2 dB of margin. Round-to-nearest gains
# about 6 dB per bit; symmetric grids lose about one bit.


class TestInt8(MethodContract):
    cases = [  # noqa: RUF012
        (Int8SymmetricConfig(), 36.0),
        (Int8SymmetricConfig(group_size=64, scale_dtype="bfloat16"), 36.0),
    ]


class TestNF4(MethodContract):
    cases = [  # noqa: RUF012
        (NF4Config(), 18.0),
        (NF4Config(blocksize=128, double_quant=False), 18.0),
    ]


class TestIQ4NL(MethodContract):
    cases = [  # noqa: RUF012
        (IQ4NLConfig(), 18.0),
        (IQ4NLConfig(group_size=128), 16.0),
    ]


class TestCustomBits(MethodContract):
    cases = [  # noqa: RUF012
        (CustomBitsConfig(bits=8, group_size=64), 40.0),
        (CustomBitsConfig(bits=4, group_size=64), 18.0),
        (CustomBitsConfig(bits=3, group_size=128, symmetric=True), 10.0),
        (CustomBitsConfig(bits=2, group_size=32), 5.0),
        (CustomBitsConfig(bits=5, group_size=None, scale_dtype="float32"), 22.0),
    ]


class TestLut(MethodContract):
    cases = [  # noqa: RUF012
        (LutConfig(), 19.5),
        (LutConfig(bits=3, group_size=128), 13.0),
        (LutConfig(bits=2, group_size=32, scale_dtype="bfloat16"), 7.5),
    ]
