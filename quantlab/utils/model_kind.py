"""Whether a model predicts next tokens (a causal LM) or only encodes text (an encoder)."""

from torch import nn


def is_language_model(model: nn.Module) -> bool:
    """True for a model that generates (a causal LM); False for an encoder, which is evaluated on lines
    of text by its embeddings, calibrated after them and distilled on its hidden states."""
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else False
