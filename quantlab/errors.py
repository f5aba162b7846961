"""Errors quantlab raises for user mistakes.

Every error says what is wrong and how to fix it. The CLI prints `QuantlabError`s as one
line on stderr with exit code 2 instead of a traceback.
"""


class QuantlabError(Exception):
    """Base class of every error caused by user input (bad config, bad weights, bad path)."""


class ConfigError(QuantlabError, ValueError):
    """A quantization config has an unknown option or an invalid value."""


class UnknownMethodError(QuantlabError, KeyError):
    """A method name is not in the registry."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class QuantizationError(QuantlabError, ValueError):
    """A layer cannot be quantized as asked (NaN weights, shapes that do not fit)."""


class CheckpointError(QuantlabError, ValueError):
    """A quantized checkpoint does not hold what its config says: a tensor missing, misshapen or not finite."""


class RequantizationWarning(UserWarning):
    """Merging a LoRA adapter into a quantized base rounded the merged weights again (see the message)."""


class PaddedGroupsWarning(UserWarning):
    """A group size that does not divide a layer's inputs: its last group stores padding."""


class LeftInFloatWarning(UserWarning):
    """Weights that no quantized module handles (a 3-D expert parameter, a Linear subclass with its own
    forward) stay in float; the message names them and the share of the model that was quantized."""


class DataFreeExpertsWarning(UserWarning):
    """Experts of a mixture that received too few calibration tokens were quantized by the data-free solver."""
