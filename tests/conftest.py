"""Settings for the whole suite, for `.ci/run`'s pytest-xdist run (one worker per core, a test file per worker):

- each worker, and each process a test starts, computes on its share of the cores instead of every worker on
  all of them;
- the files holding slow tests (real-model runs of minutes) are handed out first, so that the last minutes are
  not one worker finishing a long file while the other waits;
- quantized products at many rows run on the fused kernels (`QUANTLAB_KERNELS=fused`) unless a test asks for
  another product: which product a machine measures faster is a matter of timing, and the suite's results must
  not depend on it (tests/kernels/test_tune.py runs the measurement and both products).
"""

import os

os.environ.setdefault("QUANTLAB_KERNELS", "fused")

import pytest


def pytest_configure(config: pytest.Config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    threads = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes the tests start
    import torch

    torch.set_num_threads(threads)


# The files with the longest real-model tests (CI's `--durations`), handed out first, longest first.
LONGEST_FILES = (
    "tests/streaming/test_real_smollm2.py",
    "tests/eval/test_real_smollm2.py",
    "tests/cli/test_real_models.py",
    "tests/export/test_real_smollm2.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`LONGEST_FILES`, then the other files with slow tests, then the rest; the order within a file and among
    files of one kind is kept."""
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow") is not None}

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        if path in LONGEST_FILES:
            return LONGEST_FILES.index(path)
        return len(LONGEST_FILES) if path in slow_files else len(LONGEST_FILES) + 1

    items.sort(key=rank)
