"""Settings for the whole suite: under pytest-xdist (`.ci/run` runs one worker per core) each worker, and each
process a test starts, computes on its share of the cores instead of every worker on all of them."""

import os


def pytest_configure(config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    threads = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes the tests start
    import torch

    torch.set_num_threads(threads)
