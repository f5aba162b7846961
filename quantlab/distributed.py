"""Calibration across processes: `torchrun --nproc-per-node N -m quantlab quantize ...`.

Every process loads the model, takes a contiguous share of whole batches of the calibration
windows (`share_of_windows`: rank r of N gets batches `[r*B//N, (r+1)*B//N)`), and the
statistics it computes from its share are combined, so every process holds the one-process
statistics. Each layer is then solved by one process, which broadcasts its stored tensors
(`calibration.solving`): every process ends with the same quantized weights, and rank 0 alone
writes and prints. Each process holds its own model: N processes on one machine take N times
the memory of one.
torchrun's environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...) is read by
`init_process_group`: gloo on CPU, NCCL when CUDA is present; several nodes the same way
(`--nnodes`, `--rdzv-endpoint`).

How the combined statistics equal those of one process:

- Input statistics (GPTQ's `X^T X`, per-channel `|x|` sums, counts) are summed (`sum_`). Each
  batch's `X^T X` is a float32 product, as in one process, and the products are added in
  float64: a sum of n float32 values is exact in float64 when their magnitudes lie within
  `2^(28 - log2 n)` of each other, so for such entries the order of addition (one process, or
  each rank then the all-reduce) cannot change it; otherwise the sums differ by at most
  `n * 2^-53` relative, and the float32 mean read by the solvers by at most one ulp.
- Small per-batch statistics (AWQ's per-candidate output errors and channel magnitudes, the
  Fisher of mixed precision) are gathered in batch order (`gather_in_order`) and added in the
  one-process order on every rank: bit for bit the one-process values.

Equal per-batch values need equal per-batch arithmetic: the same batches (hence the split by
whole batches) and the same number of threads per process (BLAS reductions may depend on it;
torchrun sets `OMP_NUM_THREADS=1` when N > 1).
"""

import datetime
import hashlib
import os
from typing import TypeVar

import torch
import torch.distributed as dist

from quantlab.errors import QuantizationError

T = TypeVar("T")
# How long a rank waits for the others; rank 0 alone writes (and evaluates) the checkpoint meanwhile.
TIMEOUT = datetime.timedelta(hours=2)
_FAILURES = "quantlab/failures"
_STORE_TIMEOUT = datetime.timedelta(seconds=5)
_joined: list[bool] = []  # whether `init` made the process group (so `finish` destroys it)


def launched() -> bool:
    """Whether this process is one of several started by torchrun (or another launcher setting `WORLD_SIZE`)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init() -> bool:
    """Join the launch's process group if launched and not joined yet; returns whether calibration is shared."""
    if launched() and not dist.is_available():
        raise QuantizationError("this build of torch has no torch.distributed; run quantlab as one process")
    if launched() and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=TIMEOUT)
        _joined.append(True)
    return active()


def active() -> bool:
    """Whether several processes share this calibration (a process group of more than one)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank; before the group is joined, the launcher's `RANK` (0 alone)."""
    return dist.get_rank() if active() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    """Whether this process writes and prints (rank 0)."""
    return rank() == 0


def describe() -> str:
    """`rank 1 of 2`, for messages that one rank prints on behalf of all."""
    return f"rank {rank()} of {int(os.environ.get('WORLD_SIZE', world_size()))}"


def batch_share(batches: int) -> range:
    """The batches of this rank: a contiguous share, in order, sizes differing by at most one."""
    ranks, me = world_size(), rank()
    return range(me * batches // ranks, (me + 1) * batches // ranks)


def share_of_windows(windows: torch.Tensor, batch_size: int) -> torch.Tensor:
    """This rank's windows: its `batch_share` of the batches of `batch_size` windows (all of them alone).

    Checks first that every rank holds the same windows (a calibration text that differs between
    nodes would otherwise quantize a different model on each)."""
    if not active():
        return windows
    check_same(windows, "calibration windows", "give every node the same --calibration-text")
    batches = -(-len(windows) // batch_size)
    if batches < world_size():
        raise QuantizationError(
            f"{world_size()} processes need at least {world_size()} batches of {batch_size} calibration windows, "
            f"and there are {len(windows)} windows; pass --calibration-samples {world_size() * batch_size} "
            f"or more, or start fewer processes"
        )
    share = batch_share(batches)
    return windows[share.start * batch_size : share.stop * batch_size]


def check_same(tensor: torch.Tensor, what: str, fix: str) -> None:
    """Raise on every rank unless all ranks hold the same `tensor` (compared by a hash)."""
    if not active():
        return
    digest = hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).digest()
    mine = torch.tensor(list(digest[:8]), dtype=torch.int64)
    if not torch.equal(gather_in_order(mine.unsqueeze(0)), mine.expand(world_size(), -1)):
        raise QuantizationError(f"the processes hold different {what}; {fix}")


def sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place; returns it."""
    if active():
        reduced = tensor.to(_device())
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        if reduced is not tensor:
            tensor.copy_(reduced)
    return tensor


def total(count: int) -> int:
    """A count summed over all ranks."""
    return int(sum_(torch.tensor([count], dtype=torch.int64)).item()) if active() else count


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on some rank."""
    return total(int(flag)) > 0


def gather_in_order(rows: torch.Tensor) -> torch.Tensor:
    """The rows (first dimension) of every rank's `rows`, concatenated in rank order.

    With the windows split by `batch_share`, per-batch rows come back in the one-process batch order."""
    if not active():
        return rows
    counts = torch.tensor([rows.shape[0]], dtype=torch.int64, device=_device())
    all_counts = [torch.empty_like(counts) for _ in range(world_size())]
    dist.all_gather(all_counts, counts)
    sizes = [int(count.item()) for count in all_counts]
    padded = torch.zeros((max(sizes), *rows.shape[1:]), dtype=rows.dtype, device=_device())
    padded[: rows.shape[0]] = rows.to(_device())
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)]).to(rows.device)


def sum_rows_in_order(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's per-batch rows gathered in batch order and added one after another (as one process would)."""
    gathered = gather_in_order(rows)
    result = torch.zeros(gathered.shape[1:], dtype=gathered.dtype)
    for row in gathered:
        result += row
    return result


def broadcast_(tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
    """Overwrite `tensor` on every rank with rank `source`'s, in place; returns it."""
    if active():
        shared = tensor.to(_device())
        dist.broadcast(shared, source)
        if shared is not tensor:
            tensor.copy_(shared)
    return tensor


def from_main(value: T) -> T:
    """Rank 0's `value` on every rank (a picklable object); the other ranks wait for it."""
    if not active():
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def claim_failure() -> bool:
    """Whether this process should print the error that ends the run: the first rank to fail does,
    the others stay silent (torchrun stops them), so a failure reads as one line."""
    if not launched():
        return True
    if not active():  # before the group is joined every rank fails alike (arguments, files): rank 0 speaks
        return rank() == 0
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(_STORE_TIMEOUT)
        return store.add(_FAILURES, 1) == 1
    except (RuntimeError, ValueError, AttributeError):  # the store went down with its host: speak up
        return True


def finish() -> None:
    """Leave the process group `init` joined (at the end of a command); one the caller made stays."""
    if _joined and dist.is_initialized():
        dist.destroy_process_group()
    _joined.clear()


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
