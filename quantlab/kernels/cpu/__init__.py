"""Native CPU kernels: fused dequantize+matmul for quantlab's storage codecs (`linear.py`), and the
native quantize ops (`quantize.py`), each registered in its table for "cpu"."""

from quantlab.kernels.cpu import linear, quantize  # noqa: F401  (registers the kernels and ops)
