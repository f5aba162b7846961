"""Training state as JSON + safetensors: every form the loop stores comes back equal, anything else is refused."""

import json
import math
import random

import numpy as np
import pytest
import torch

from quantlab.training.state_files import StateFileError, read_state, write_state


def test_optimizer_rng_and_callback_states_round_trip(tmp_path):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 2))], lr=1e-3, betas=(0.9, 0.99))
    optimizer.param_groups[0]["params"][0].grad = torch.ones(3, 2)
    optimizer.step()
    state = {
        "optimizer": optimizer.state_dict(),  # int keys, tuples, None, 0-dim tensors
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # a uint32 array inside a tuple
        "torch": torch.get_rng_state(),
        "odd": {"__tensor__": 1, "inf": math.inf, "nan": math.nan, "nested": [(1, "a"), {"b": None}]},
    }
    write_state(state, tmp_path, "state")
    back = read_state(tmp_path, "state")

    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 2))], lr=1e-3, betas=(0.9, 0.99))
    fresh.load_state_dict(back["optimizer"])
    assert fresh.param_groups[0]["betas"] == (0.9, 0.99)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    assert back["numpy"][1].dtype == np.uint32 and np.array_equal(back["numpy"][1], state["numpy"][1])
    assert torch.equal(back["torch"], state["torch"])
    assert back["odd"]["__tensor__"] == 1 and back["odd"]["inf"] == math.inf and math.isnan(back["odd"]["nan"])
    assert back["odd"]["nested"] == [(1, "a"), {"b": None}]


def test_a_value_that_would_need_pickle_is_refused_when_saved(tmp_path):
    with pytest.raises(StateFileError, match=r"callbacks\[0\].schedule is a object; .* without pickle"):
        write_state([{"schedule": object()}], tmp_path, "callbacks")


@pytest.mark.parametrize(
    ("structure", "message"),
    [
        ({"__tensor__": "7"}, "refers to tensor '7'"),
        ({"__ndarray__": "0", "dtype": "object"}, "arrays hold numbers"),
        ({"__items__": [[[1], 2]]}, "malformed"),
        ({"__tuple__": 3}, "malformed __tuple__"),
    ],
)
def test_an_edited_structure_is_refused_when_read(structure, message, tmp_path):
    write_state({"x": torch.zeros(2)}, tmp_path, "state")
    (tmp_path / "state.json").write_text(json.dumps(structure))
    with pytest.raises(StateFileError, match=message):
        read_state(tmp_path, "state")
