"""Errors of the ONNX export."""

from quantlab.errors import QuantlabError


class ExportError(QuantlabError, ValueError):
    """A model, layer or operator cannot be exported to ONNX; the message names it."""
