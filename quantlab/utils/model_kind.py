"""Whether a model predicts next tokens (a causal LM) or only encodes text (an encoder), and which class a config
builds."""

from typing import Any

from torch import nn


def is_language_model(model: nn.Module) -> bool:
    """True for a model that generates (a causal LM); False for an encoder, which is evaluated on lines
    of text by its embeddings, calibrated after them and distilled on its hidden states."""
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else False


def model_class(config: Any) -> type:
    """The class named in `config.architectures` (heads included), else the auto class for the type."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for name in getattr(config, "architectures", None) or []:
        found = getattr(transformers, name, None)
        if isinstance(found, type):
            return found
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel
