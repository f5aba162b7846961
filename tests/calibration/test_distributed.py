"""Calibration shared between processes (gloo on CPU) gives the one-process model, bit for bit."""

import contextlib
import hashlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import quantlab
from quantlab import distributed
from quantlab.calibration.solving import solver_ranks
from quantlab.errors import QuantizationError
from quantlab.registry import method_of
from quantlab.solvers import InputStats
from quantlab.testing import tiny_llama

WORLD = 2
WINDOWS = torch.randint(0, 256, (24, 32), generator=torch.Generator().manual_seed(0))  # 3 batches of 8
CONFIGS = {
    "gptq": {"solver": "gptq"},
    "awq + gptq": {"solver": "gptq", "awq": True},
    "mixed precision": {"solver": "gptq", "target_bits": 4.5},
    "awq + rtn": {"awq": True},
    "self-calibrated gptq": {"solver": "gptq", "self_calibration": True, "calibration_samples": 16},
}


def _config(options: dict) -> quantlab.CustomBitsConfig:
    return quantlab.CustomBitsConfig(bits=4, group_size=32, calibration_seq_len=32, **options)


def _quantized_hashes() -> dict[str, str]:
    """Each configuration's quantized tiny Llama, as a hash of its state dict."""
    hashes = {}
    for name, options in CONFIGS.items():
        calibration = None if options.get("self_calibration") else WINDOWS
        model = quantlab.quantize(tiny_llama(), _config(options), calibration=calibration, progress=False)
        digest = hashlib.sha256()
        for key, tensor in sorted(model.state_dict().items()):
            digest.update(key.encode())
            digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
        hashes[name] = digest.hexdigest()
    return hashes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(rank: int, port: int, results: dict) -> None:
    """One process of the group: the collective helpers, then every configuration calibrated together."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        ordered = distributed.gather_in_order(torch.full((rank + 1, 2), float(rank)))
        first_failure = distributed.claim_failure()
        try:
            distributed.share_of_windows(WINDOWS + rank, 8)
            different_windows = None
        except QuantizationError as error:
            different_windows = str(error)
        with _counted_solves() as solves:
            hashes = _quantized_hashes()
        results[rank] = {
            "ordered": ordered.tolist(),
            "first_failure": first_failure,
            "different_windows": different_windows,
            "share": distributed.share_of_windows(WINDOWS, 8).tolist(),
            "hashes": hashes,
            "solves": solves[0],
        }
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _counted_solves():
    """Counts the layers this process solves (`quantize_checked` calls of the method's layer class)."""
    module_class = method_of(_config({})).module_class
    own = vars(module_class).get("quantize_checked")
    solve = module_class.quantize_checked
    count = [0]

    def counted(cls, *args, **kwargs):
        count[0] += 1
        return solve(*args, **kwargs)

    module_class.quantize_checked = classmethod(counted)
    try:
        yield count
    finally:
        if own is None:
            del module_class.quantize_checked
        else:
            module_class.quantize_checked = own


@pytest.fixture(scope="module")
def together() -> dict:
    """What each of two gloo processes computed."""
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(_free_port(), results), nprocs=WORLD, join=True)
    return dict(results)


@pytest.fixture(scope="module")
def alone() -> dict[str, str]:
    """The one-process hashes, with one thread as the processes had."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _quantized_hashes()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_process_ends_with_the_one_process_model(together, alone, name):
    assert together[0]["hashes"][name] == together[1]["hashes"][name]
    assert together[0]["hashes"][name] == alone[name]


def test_the_layers_are_solved_once_between_the_processes(together):
    """Each layer by one process, dealt by cost: in the tiny Llama, down_proj (192 inputs) weighs more
    than the six others together, so one process solves it and the other the rest."""
    block = tiny_llama().model.layers[0]
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    owners = solver_ranks([float(m.in_features) ** 2 * m.out_features + float(m.in_features) ** 3 for m in linears], 2)
    per_block = [owners.count(rank) for rank in range(WORLD)]
    assert per_block == [1, 6]
    assert [together[rank]["solves"] for rank in range(WORLD)] == [2 * len(CONFIGS) * n for n in per_block]


@pytest.mark.parametrize(
    ("costs", "expected"), [([1, 1, 1, 1], [0, 1, 0, 1]), ([10, 1, 1, 1, 1], [0, 1, 1, 1, 1]), ([3, 2, 2], [0, 1, 1])]
)
def test_layers_are_dealt_largest_first_to_the_least_loaded_process(costs, expected):
    assert solver_ranks(costs, 2) == expected
    assert solver_ranks(costs, 1) == [0] * len(costs)


def test_each_process_takes_a_contiguous_share_of_whole_batches(together):
    assert together[0]["share"] == WINDOWS[:8].tolist()  # 3 batches: rank 0 gets 1, rank 1 gets 2
    assert together[1]["share"] == WINDOWS[8:].tolist()


def test_gathered_rows_come_in_rank_order(together):
    assert together[0]["ordered"] == together[1]["ordered"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]


def test_exactly_one_failing_process_prints(together):
    assert sorted(result["first_failure"] for result in together.values()) == [False, True]


def test_processes_with_different_windows_refuse(together):
    for result in together.values():
        assert "different calibration windows" in result["different_windows"]


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("batches", [5, 16, 17])
def test_batch_shares_cover_the_batches_in_order(monkeypatch, ranks, batches):
    shares = []
    for rank in range(ranks):
        monkeypatch.setattr(distributed, "world_size", lambda: ranks)
        monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
        shares.append(distributed.batch_share(batches))
    assert [index for share in shares for index in share] == list(range(batches))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_input_statistics_add_up_to_the_one_process_hessian_bit_for_bit():
    """Each batch's X^T X in float32, summed in float64: the order of the sums does not change the mean
    (activation-like inputs: a few channels 20x larger than the rest)."""
    generator = torch.Generator().manual_seed(0)
    scale = torch.ones(256)
    scale[:8] = 20
    batches = [torch.randn(8, 32, 256, generator=generator) * scale for _ in range(16)]
    alone = InputStats(256)
    for batch in batches:
        alone.add(batch)
    shares = [InputStats(256) for _ in range(3)]
    for share, part in zip(shares, ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9], list(range(10, 16))), strict=True):
        for index in part:
            share.add(batches[index])
    summed = InputStats(256)
    for share in reversed(shares):  # any order of the all-reduce
        summed.gram += share.gram
        summed.count += share.count
    assert torch.equal(summed.hessian, alone.hessian)


def test_reduced_statistics_keep_only_their_means():
    stats = InputStats(16)
    stats.add(torch.randn(64, 16))
    before = stats.hessian.clone()
    stats.all_reduce()  # one process: nothing to sum
    assert not distributed.active() and torch.equal(stats.hessian, before) and stats.count == 64
    assert stats.gram is None
    with pytest.raises(RuntimeError, match="reduced"):
        stats.add(torch.randn(4, 16))
