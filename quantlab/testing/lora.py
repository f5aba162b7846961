"""One LoRA training step on a quantized model, for tests of a storage format (built-in or a plugin's)."""

import torch
from torch import nn


def lora_step(model: nn.Module, ids: torch.Tensor) -> tuple[bool, set[str]]:
    """Wrap `model` (a quantized causal LM) with LoRA adapters of non-zero start (r=4), take one AdamW step
    on `ids` as labels; returns whether every buffer (the codes, scales, tables) kept its value, and the
    names of the parameters the step changed (only `lora_` ones should be)."""
    from peft import prepare_model_for_kbit_training

    from quantlab.training import add_lora

    prepare_model_for_kbit_training(model, False)
    torch.manual_seed(1)
    model = add_lora(model, r=4, alpha=8, dropout=0.0, init_lora_weights=False)
    buffers = {name: tensor.clone() for name, tensor in model.named_buffers()}
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    kept = all(torch.equal(tensor, buffers[name]) for name, tensor in model.named_buffers())
    changed = {name for name, parameter in model.named_parameters() if not torch.equal(parameter, before[name])}
    return kept, changed
