"""quantlab's method contract, run on the `hqq` plugin across widths and group sizes."""

from quantlab.testing.contract import MethodContract, assert_method_available
from quantlab_hqq import HqqConfig

assert_method_available("hqq")

# SQNR floors on N(0, 0.02) weights: measured, less about 2 dB. Measured (dB), hqq against
# custom_bits round-to-nearest: 8/g64 45.8 vs 45.5; 4/g64 21.2 vs 20.9; 4/g128 with the scale
# refit 20.5 vs 20.0; 3/g64 14.6 vs 14.3; 2/g32 8.4 vs 8.1; 3/per channel 12.1 vs 11.9.


class TestHqq(MethodContract):
    cases = [  # noqa: RUF012
        (HqqConfig(bits=8, group_size=64), 43.5),
        (HqqConfig(bits=4, group_size=64), 19.0),
        (HqqConfig(bits=4, group_size=128, optimize_scale=True), 18.5),
        (HqqConfig(bits=3, group_size=64), 12.5),
        (HqqConfig(bits=2, group_size=32), 6.5),
        (HqqConfig(bits=3, group_size=None, scale_dtype="float32"), 10.0),
    ]
