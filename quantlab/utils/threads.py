"""Running a stretch of small tensor operations on one thread."""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """torch on one thread inside the block, the previous count restored after.

    For loops of many small operations (GPTQ's column steps): their parallel regions are
    too short to pay for waking a second thread, and on a busy machine each one waits for a
    worker the scheduler has not run, so one thread is both faster and steadier there.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
