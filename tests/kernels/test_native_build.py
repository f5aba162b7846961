"""Building, finding and falling back from the native library; its threads (torch's team, its own pool, fork)."""

import multiprocessing
import sys
import warnings
from pathlib import Path

import pytest
import torch

import quantlab
from quantlab import CustomBitsConfig
from quantlab.kernels.cpu import build, native
from quantlab.kernels.cpu.linear import native_dequantize, native_linear
from quantlab.kernels.cpu.weights import native_weight
from quantlab.kernels.reference import dequantize_matmul


def layer(in_features: int = 512, out_features: int = 1024):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features)
    return quantlab.get_method("custom_bits").module_class.from_linear(linear, CustomBitsConfig(bits=4))


def test_disabled_by_environment_runs_the_reference(monkeypatch, library):
    module, x = layer(), torch.randn(3, 512)
    monkeypatch.setenv("QUANTLAB_NATIVE_KERNELS", "0")
    assert native.library() is None
    with torch.no_grad():
        assert torch.equal(native_linear(module, x), dequantize_matmul(module, x))


def test_without_a_compiler_warns_once_and_returns_none(monkeypatch, tmp_path):
    monkeypatch.delenv("QUANTLAB_CPU_KERNELS", raising=False)
    monkeypatch.setenv("QUANTLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert native._load.__wrapped__() is None
    with pytest.raises(native.NativeBuildError, match="no C compiler"):
        native.build()


def test_a_failing_compiler_reports_its_command(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "compiler", lambda: "/bin/false")
    monkeypatch.setattr(native, "_compiler_identity", lambda cc: "false")
    with pytest.raises(native.NativeBuildError, match="/bin/false"):
        native.build()
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob(".*tmp*"))


def test_the_library_lives_in_the_cache_not_the_package(library, capsys):
    assert build.main([]) == 0
    paths = [Path(line) for line in capsys.readouterr().out.split()]
    assert [path.suffix for path in paths] == [".so", ".so"]  # the C library, the torch operators
    package = Path(quantlab.__file__).parent
    for path in paths:
        assert path.is_file() and path.parent.parent == native.cache_dir()
        assert package not in path.parents
    assert not list(package.rglob("*.so"))


def _gemm(module, x: torch.Tensor, threads: int) -> torch.Tensor:
    weight = native_weight(module)
    out = torch.empty(x.shape[0], weight.out_features)
    status = native.library().ql_gemm(
        weight.pointer, x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), 1024, threads
    )
    assert status == 0
    return out


def _child_result(queue, module, x) -> None:
    torch.set_num_threads(1)  # torch's own OpenMP pool is not usable after fork; the native pool must be
    queue.put(_gemm(module, x, threads=2).tolist())  # plain data: a tensor would travel as a file descriptor


def test_native_thread_pool_works_in_a_forked_child(library):
    module, x = layer(), torch.ones(2, 512)
    expected = _gemm(module, x, threads=2)  # starts the pool's worker in this process
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        child = context.Process(target=_child_result, args=(queue, module, x))
        child.start()
    try:
        result = queue.get(timeout=120)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert torch.equal(torch.tensor(result), expected)


@pytest.fixture
def threads_restored(library):
    """The loaded library; afterwards its kernels go back to torch's team (where `_load` put them)."""
    lib = native.library()
    yield lib
    native._choose_threads(lib)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or "parallel backend: OpenMP" not in torch.__config__.parallel_info(),
    reason="torch's Linux wheels run on libgomp; elsewhere the kernels keep their own pool",
)
def test_kernels_join_torchs_openmp_team_on_linux(library):
    assert native.thread_pool() == "torch"


@pytest.mark.skipif(native.torch_gomp_parallel() is None, reason="torch does not run on libgomp here")
def test_the_environment_keeps_the_kernels_on_their_own_pool(threads_restored, monkeypatch):
    threads_restored.ql_use_openmp(native.torch_gomp_parallel())
    assert native.thread_pool() == "torch"
    monkeypatch.setenv("QUANTLAB_THREAD_POOL", "own")
    native._choose_threads(threads_restored)
    assert native.thread_pool() == "own"


@pytest.mark.skipif(native.torch_gomp_parallel() is None, reason="torch does not run on libgomp here")
def test_a_stalled_join_on_torchs_team_moves_the_next_calls_to_the_own_pool(threads_restored):
    """Three joins in a row that waited for an absent team thread (here: a negative bound, so every call counts)
    send the calls after them to the library's own pool until the pause ends; then the calls go back to the team."""
    module, x = layer(), torch.randn(64, 512)
    expected = _gemm(module, x, threads=1)
    threads_restored.ql_use_openmp(native.torch_gomp_parallel())
    calls = threads_restored.ql_pool_calls
    try:
        threads_restored.ql_set_team_stall_ns(-(10**15), 60 * 10**9)
        team, own = calls(1), calls(0)
        results = [_gemm(module, x, threads=2) for _ in range(5)]
        runs = 2 * 5  # at 64 rows a product is two parallel runs: x copied into the kernels' layout, then the product
        assert (calls(1) - team, calls(0) - own) == (3, runs - 3)  # each run stalls "by definition"; three leave
        threads_restored.ql_set_team_stall_ns(60 * 10**9, 10**9)  # the pause ends; no call can stall that long
        team = calls(1)
        results += [_gemm(module, x, threads=2) for _ in range(3)]
        assert calls(1) - team == 2 * 3
    finally:
        threads_restored.ql_set_team_stall_ns(10**6, 10**9)
    for result in results:
        assert torch.equal(result, expected)


@pytest.mark.parametrize("rows", [1, 15, 16, 64])
def test_both_thread_pools_compute_the_same_result(threads_restored, rows):
    module, x = layer(), torch.randn(rows, 512)
    alone = _gemm(module, x, threads=1)
    decoded = native_dequantize(native_weight(module))
    for gomp_parallel in (None, native.torch_gomp_parallel()):
        threads_restored.ql_use_openmp(gomp_parallel)
        assert torch.equal(_gemm(module, x, threads=2), alone)  # each output is written by one thread
        assert torch.equal(native_dequantize(native_weight(module)), decoded)


def test_force_isa_runs_a_lower_instruction_set_and_refuses_unknown_names(library):
    best = native.isa()
    try:
        native.force_isa("scalar")
        assert native.isa() == "scalar"
        native.force_isa("avx512")  # never above what the CPU has
        assert native.isa() == best
    finally:
        native.force_isa("native")
    assert native.isa() == best
    with pytest.raises(ValueError, match="unknown instruction set 'sse9'"):
        native.force_isa("sse9")
