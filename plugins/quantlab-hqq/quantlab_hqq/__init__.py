"""quantlab-hqq: the `hqq` quantization method for quantlab, installed as a plugin.

Installing the package is enough: quantlab finds `register` through the entry-point group
`quantlab.methods` the first time a method is looked up, so `quantlab.list_methods()`,
`from_pretrained(..., quantization_config=HqqConfig())` and `quantlab quantize --method hqq`
work without importing this package.
"""

from quantlab_hqq.method import HqqConfig, HqqLinear

__version__ = "0.1.0"
SOURCE = "quantlab-hqq"


def register() -> None:
    """Entry point: register `hqq` with quantlab (and through it with transformers)."""
    from quantlab import register_method

    register_method(HqqConfig, HqqLinear, source=SOURCE)


__all__ = ["HqqConfig", "HqqLinear", "register"]
