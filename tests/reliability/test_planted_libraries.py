"""Native code is loaded only from the user's private, verified cache: planted or altered libraries are refused.

Each case prepares a kernel cache the way another user, a careless copy or a permissive umask
would leave it, then runs a fresh process on it (the library is loaded once per process). A
refused library gives one warning line naming the path and the reason, its code never runs
(the planted library writes a marker file from its constructor), and the tiny quantized model
still computes what its dequantized float copy computes, through the reference kernel.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from quantlab.kernels.cpu import native

CHILD = r"""
import copy, json, warnings
import torch
import quantlab
from quantlab.kernels.cpu import native, ops
from quantlab.testing.models import tiny_llama

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = tiny_llama()
    quantlab.quantize(model, quantlab.CustomBitsConfig(bits=4, group_size=32))
    reference = quantlab.dequantize(copy.deepcopy(model))
    ids = torch.arange(3, 15).view(1, 12)
    with torch.no_grad():
        error = (model(ids).logits - reference(ids).logits).abs().max().item()
    loaded = native.library() is not None
    operators = ops.available()
print(json.dumps({
    "native": loaded,
    "operators": operators,
    "warnings": [str(w.message) for w in caught if "native" in str(w.message)],
    "max_error": error,
}))
"""

PAYLOAD = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(getenv("PLANTED_MARKER"), "w");
    if (marker) { fputs("planted code ran", marker); fclose(marker); }
}
"""


def run_child(cache: Path, marker: Path, umask: int | None = None, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("QUANTLAB_")}
    environment.update(QUANTLAB_CACHE=str(cache), PLANTED_MARKER=str(marker), **env)
    result = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=None if umask is None else (lambda: os.umask(umask)),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> tuple[Path, Path]:
    """A cache with the kernels built once (copied for each case): (cache root, library path)."""
    if native.compiler() is None:
        pytest.skip("no C compiler: nothing is built or loaded here")
    root = tmp_path_factory.mktemp("template") / "cache"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("QUANTLAB_")}
    result = subprocess.run(
        [sys.executable, "-m", "quantlab.kernels.cpu.build"],
        env={**environment, "QUANTLAB_CACHE": str(root)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    kernels, operators = result.stdout.split()  # the C library, then the torch operator extension
    return root, Path(kernels), Path(operators)


@pytest.fixture
def cache(built_cache, tmp_path) -> tuple[Path, Path, Path]:
    """A private copy of the built cache (modes kept): (cache root, C library, operator extension)."""
    template, library, operators = built_cache
    root = tmp_path / "cache"
    shutil.copytree(template, root, copy_function=shutil.copy2)
    return root, root / library.relative_to(template), root / operators.relative_to(template)


@pytest.fixture
def planted(tmp_path) -> Path:
    """A library whose constructor writes `$PLANTED_MARKER`: proof that it was loaded."""
    source = tmp_path / "planted.c"
    source.write_text(PAYLOAD)
    library = tmp_path / "planted.so"
    subprocess.run([native.compiler(), "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    return library


def _chmod(which: Callable[[Path], Path], mode: int) -> Callable[[Path, Path], None]:
    return lambda library, planted: os.chmod(which(library), mode)


def _replace(library: Path, planted: Path) -> None:
    shutil.copyfile(planted, library)
    os.chmod(library, 0o700)


def _symlink(library: Path, planted: Path) -> None:
    library.unlink()
    library.symlink_to(planted)


def _drop_record(library: Path, planted: Path) -> None:
    library.with_name(library.name + ".sha256").unlink()


def _planted_before_the_build(library: Path, planted: Path) -> None:
    """Someone pre-creates the predictable folder, world-writable, with their library and a matching record."""
    shutil.rmtree(library.parent.parent)
    library.parent.mkdir(parents=True)
    for folder in (library.parent, library.parent.parent):
        os.chmod(folder, 0o777)
    _replace(library, planted)
    digest = subprocess.run(["sha256sum", str(library)], capture_output=True, text=True, check=True).stdout.split()[0]
    library.with_name(library.name + ".sha256").write_text(digest + "\n")


CASES = [
    ("cache folder world-writable", _chmod(lambda lib: lib.parent.parent, 0o777), "writable by group or others"),
    ("cache folder group-writable", _chmod(lambda lib: lib.parent.parent, 0o770), "writable by group or others"),
    ("build folder world-writable", _chmod(lambda lib: lib.parent, 0o777), "writable by group or others"),
    ("library world-writable", _chmod(lambda lib: lib, 0o777), "writable by group or others"),
    ("library replaced", _replace, "differs from the one recorded"),
    ("library is a symlink", _symlink, "symbolic link"),
    ("build record missing", _drop_record, "records what was built"),
    ("planted before the first build", _planted_before_the_build, "writable by group or others"),
]


@pytest.mark.parametrize(("case", "tamper", "reason"), CASES, ids=[case[0] for case in CASES])
def test_tampered_cache_is_refused_and_the_model_stays_correct(cache, planted, tmp_path, case, tamper, reason):
    root, library, _ = cache
    tamper(library, planted)
    marker = tmp_path / "marker"
    result = run_child(root, marker)
    assert not marker.exists(), "the planted library's code ran"
    assert not result["native"]
    [warning] = result["warnings"]
    assert "\n" not in warning and "refusing to load native code from" in warning and reason in warning
    assert str(root) in warning
    assert result["max_error"] <= 1e-5


def test_intact_cache_is_loaded(cache, tmp_path):
    root, _, _ = cache
    result = run_child(root, tmp_path / "marker")
    assert result["native"] and result["operators"] and result["warnings"] == []
    assert result["max_error"] <= 1e-4


OPERATOR_CASES = [CASES[2], CASES[4], CASES[5]]  # its folder writable, replaced, a symlink


@pytest.mark.parametrize(("case", "tamper", "reason"), OPERATOR_CASES, ids=[case[0] for case in OPERATOR_CASES])
def test_tampered_operator_extension_is_refused(cache, planted, tmp_path, case, tamper, reason):
    """The torch operators follow the same rule; refused, the layers call the verified C library through ctypes."""
    root, _, operators = cache
    tamper(operators, planted)
    marker = tmp_path / "marker"
    result = run_child(root, marker)
    assert not marker.exists(), "the planted library's code ran"
    assert result["native"] and not result["operators"]
    [warning] = result["warnings"]
    assert "torch operators are unavailable" in warning and str(operators.parent) in warning and reason in warning
    assert result["max_error"] <= 1e-4


def test_build_under_umask_000_is_private(built_cache, tmp_path):
    root = tmp_path / "new" / "cache"  # two parents to create as well
    result = run_child(root, tmp_path / "marker", umask=0)
    assert result["native"] and result["operators"] and result["warnings"] == []
    created = [tmp_path / "new", *sorted((tmp_path / "new").rglob("*"))]
    modes = {path.relative_to(tmp_path).as_posix(): stat.S_IMODE(path.lstat().st_mode) for path in created}
    assert all(mode & 0o077 == 0 for mode in modes.values()), modes
    assert [p for p in modes if p.endswith(".so")] and [p for p in modes if p.endswith(".sha256")]
    assert not [p for p in modes if "build-" in p or "objects-" in p]  # no staging left behind


def test_chosen_library_writable_by_others_is_refused(built_cache, planted, tmp_path):
    chosen = tmp_path / "chosen.so"
    shutil.copyfile(planted, chosen)
    os.chmod(chosen, 0o777)
    marker = tmp_path / "marker"
    result = run_child(tmp_path / "cache", marker, QUANTLAB_CPU_KERNELS=str(chosen), QUANTLAB_TORCH_OPS="0")
    assert not marker.exists() and not result["native"]
    [warning] = result["warnings"]
    assert str(chosen) in warning and "writable by group or others" in warning and "QUANTLAB_CPU_KERNELS" in warning
    assert result["max_error"] <= 1e-5


def test_chosen_library_of_the_user_is_loaded(built_cache, tmp_path):
    chosen = tmp_path / "prebuilt" / "libquantlab_cpu.so"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("QUANTLAB_")}
    subprocess.run(
        [sys.executable, "-m", "quantlab.kernels.cpu.build", "--output", str(chosen)],
        env=environment,
        check=True,
        capture_output=True,
        timeout=600,
    )
    assert stat.S_IMODE(chosen.stat().st_mode) == 0o755
    result = run_child(
        tmp_path / "cache", tmp_path / "marker", QUANTLAB_CPU_KERNELS=str(chosen), QUANTLAB_TORCH_OPS="0"
    )
    assert result["native"] and not result["operators"] and result["warnings"] == []
    assert not (tmp_path / "cache").exists()  # nothing built: the chosen library was used
