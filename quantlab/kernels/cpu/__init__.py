"""Native CPU kernels: fused dequantize+matmul for quantlab's stored formats (see `linear.py`)."""

from quantlab.kernels.cpu import linear  # noqa: F401  (registers the kernels)
