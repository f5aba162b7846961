"""Checks run on a weight before it is quantized, through the op registered for its device.

The rounding steps themselves are the codecs' (`quantlab.formats`), with their fast paths in
`quantlab.formats.fast_path`.
"""

import torch

from quantlab.formats.fast_path import run


def count_nonfinite(values: torch.Tensor) -> int:
    """How many NaN/Inf values a float tensor holds (natively one pass and no temporary mask)."""
    native = run("count_nonfinite", values, values)
    return native if native is not None else int((~torch.isfinite(values)).sum())
