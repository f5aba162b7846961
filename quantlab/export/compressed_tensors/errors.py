"""The compressed-tensors export's error."""

from quantlab.errors import QuantlabError


class CompressedTensorsExportError(QuantlabError, ValueError):
    """A model cannot be written as compressed-tensors exactly; the message names the layer and why."""
