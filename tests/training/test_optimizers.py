"""Optimizers by name: each one trains, 8-bit state is a quarter of AdamW's, decay skips vectors."""

import pytest
import torch
from torch import nn

from quantlab.training import Trainer, build_optimizer, optimizer_names, optimizer_state_bytes
from quantlab.training.reporting import read_log

BITSANDBYTES = {"adamw_8bit", "paged_adamw_8bit", "lion_8bit"}


@pytest.mark.parametrize("name", optimizer_names())
def test_every_optimizer_trains_a_lora_model(name, make_qlora, make_data, make_config, tmp_path):
    if name in BITSANDBYTES:
        pytest.importorskip("bitsandbytes")
    learning_rate = 3e-3 if name == "lion_8bit" else 3e-2
    config = make_config(tmp_path, max_steps=3, optim=name, learning_rate=learning_rate, lr_scheduler="constant")
    Trainer(make_qlora(r=64), config, make_data()).train()
    log = read_log(tmp_path)
    assert log[-1]["loss"] < log[0]["loss"]
    assert log[-1]["optimizer_state_mib"] > 0


def _state_bytes(name: str) -> int:
    torch.manual_seed(0)
    layer = nn.Linear(1024, 1024)
    optimizer = build_optimizer(name, layer.named_parameters(), lr=1e-3)
    layer(torch.randn(8, 1024)).square().mean().backward()
    optimizer.step()
    return optimizer_state_bytes(optimizer)


def test_8bit_adamw_state_is_at_most_0_27_of_adamw():
    pytest.importorskip("bitsandbytes")
    full, eight_bit = _state_bytes("adamw_torch"), _state_bytes("adamw_8bit")
    assert full >= 8 * 1024 * 1024  # two fp32 moments per weight
    assert eight_bit <= 0.27 * full


def test_weight_decay_skips_biases_and_norms():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    optimizer = build_optimizer("adamw_torch", model.named_parameters(), lr=1e-3, weight_decay=0.1)
    decayed, not_decayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and [p.shape for p in decayed["params"]] == [(8, 8)]
    assert not_decayed["weight_decay"] == 0.0 and len(not_decayed["params"]) == 3
