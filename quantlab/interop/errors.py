"""The error of reading or writing another library's checkpoint format."""

from quantlab.errors import QuantlabError


class ForeignCheckpointError(QuantlabError, ValueError):
    """A compressed-tensors or GPTQ checkpoint or scheme quantlab cannot read or write exactly; says why."""
