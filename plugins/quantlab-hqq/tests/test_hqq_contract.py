"""quantlab's method contract, run on the `hqq` plugin across widths and group sizes."""

from quantlab.testing.contract import MethodContract, assert_method_available
from quantlab_hqq import HqqConfig

assert_method_available("hqq")

# SQNR floors on N(0, 0.02) weights: the measured SQNR less about 2 dB. hqq's measured SQNR is a little
# above custom_bits round-to-nearest at every width and group size here (benchmarks/RESULTS.md).


class TestHqq(MethodContract):
    cases = [  # noqa: RUF012
        (HqqConfig(bits=8, group_size=64), 43.5),
        (HqqConfig(bits=4, group_size=64), 19.0),
        (HqqConfig(bits=4, group_size=128, optimize_scale=True), 18.5),
        (HqqConfig(bits=3, group_size=64), 12.5),
        (HqqConfig(bits=2, group_size=32), 6.5),
        (HqqConfig(bits=3, group_size=None, scale_dtype="float32"), 10.0),
    ]
