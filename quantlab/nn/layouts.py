"""The storage layout a quantized layer declares, for code that also meets layers declaring none."""

from quantlab.formats.layout import StorageLayout
from quantlab.nn.quantized_linear import QuantizedLinear


def declared_layout(layer: QuantizedLinear) -> StorageLayout | None:
    """`layer.layout`, or None when its class declares no `layout_for` (it then defines its own
    `storage_spec` and `dequantize_weight`, and registers its own kernels and ONNX lowering)."""
    try:
        return layer.layout
    except NotImplementedError:
        return None
