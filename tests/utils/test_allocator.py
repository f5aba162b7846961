"""The C allocator settings quantlab makes between and before long phases (glibc on Linux)."""

import os
import subprocess
import sys

import pytest

_SET = "from quantlab.utils.allocator import map_large_allocations; print(map_large_allocations())"


def _run(environment: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", _SET], env=environment, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_allocations_get_their_own_maps_unless_the_user_chose_a_threshold():
    environment = {key: value for key, value in os.environ.items() if key != "MALLOC_MMAP_THRESHOLD_"}
    assert _run(environment) == "True"
    assert _run({**environment, "MALLOC_MMAP_THRESHOLD_": "131072"}) == "False"


_WHERE = """
import torch
from quantlab.utils import allocator

def on_the_heap(tensor):
    with open('/proc/self/maps') as maps:
        spans = [line.split()[0].split('-') for line in maps if line.rstrip().endswith('[heap]')]
    return any(int(low, 16) <= tensor.data_ptr() < int(high, 16) for low, high in spans)

allocator.map_large_allocations()
mapped = torch.empty(1 << 18)  # 1 MiB: its own mapping above 64 KiB
with allocator.heap_for_temporaries():
    lent = torch.empty(1 << 18)
after = torch.empty(1 << 18)
print(on_the_heap(mapped), on_the_heap(lent), on_the_heap(after))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_temporaries_come_from_the_heap_while_a_solver_runs_and_large_ones_are_mapped_again_after():
    environment = {key: value for key, value in os.environ.items() if key != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run([sys.executable, "-c", _WHERE], env=environment, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True", "False"]
