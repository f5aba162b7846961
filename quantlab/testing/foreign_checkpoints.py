"""Writing checkpoints as other libraries lay them out (GPTQ, AWQ): what every import test shares."""

import json
from collections.abc import Container
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def save_packed_checkpoint(
    model: Any, folder: Path, state: dict[str, torch.Tensor], packed_layers: Container[str], quantization: dict
) -> None:
    """Save `state` (the packed layers' tensors) plus every other tensor of `model` as it stands (a tied head left
    out) to `folder/model.safetensors`, and `config.json` with `quantization` as its `quantization_config`.

    `packed_layers`: the names of the layers whose weights `state` holds in the library's packed form."""
    for key, tensor in model.state_dict().items():
        if key.rpartition(".")[0] not in packed_layers and key not in state:
            state[key] = tensor.detach().clone().contiguous()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    folder.mkdir(parents=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
