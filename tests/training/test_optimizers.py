"""8-bit optimizers by their transformers names: they train, keep 8-bit state, and checkpoint without pickle."""

import pytest
import torch

from quantlab.methods.nf4 import NF4Config
from quantlab.training import Trainer


@pytest.mark.parametrize("optim", ["adamw_8bit", "paged_adamw_8bit", "lion_8bit"])
def test_8bit_optimizers_by_transformers_name(optim, make_qlora, make_data, make_config, tmp_path):
    pytest.importorskip("bitsandbytes")
    model = make_qlora(NF4Config(), r=32)  # large enough adapters for 8-bit state (min_8bit_size 4096)
    trainer = Trainer(model, make_config(tmp_path, optim=optim, max_steps=3, save_steps=3), make_data())
    trainer.train()
    assert type(trainer.optimizer.optimizer).__module__.startswith("bitsandbytes")
    states = [s for s in trainer.optimizer.optimizer.state.values() if s]
    assert any(v.dtype == torch.uint8 for s in states for v in s.values() if isinstance(v, torch.Tensor))
    assert (tmp_path / "checkpoint-3" / "optimizer.safetensors").is_file()


def test_8bit_optimizer_state_resumes_bit_identically(make_qlora, make_data, make_config, tmp_path):
    pytest.importorskip("bitsandbytes")
    from quantlab.training import trainable_parameters

    options = {"optim": "adamw_8bit", "max_steps": 4, "save_steps": 2}
    straight = make_qlora(NF4Config(), r=32)
    Trainer(straight, make_config(tmp_path / "straight", **options), make_data()).train()
    first = Trainer(make_qlora(NF4Config(), r=32), make_config(tmp_path / "resumed", **options), make_data())
    first.train()  # writes checkpoint-2; resuming from it replays steps 3 and 4
    resumed = make_qlora(NF4Config(), r=32, lora_seed=5)
    trainer = Trainer(resumed, make_config(tmp_path / "resumed", **options), make_data())
    trainer.train(resume_from_checkpoint=tmp_path / "resumed" / "checkpoint-2")
    expected, got = trainable_parameters(straight), trainable_parameters(resumed)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
