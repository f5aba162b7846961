"""Native code is loaded only from the user's private, verified cache: planted or altered libraries are refused.

Each scenario prepares a kernel cache the way another user, a careless copy or a permissive umask
would leave it, then loads it in a fresh process. A refused library gives one warning line naming
the path and the reason, its code never runs (the planted library writes a marker file from its
constructor), and the tiny quantized model still computes what its dequantized float copy
computes, through the reference kernel.

A process loads a library once and keeps it, so a child runs a list of scenarios in order and
clears the loader's per-process memo between them: one child runs every scenario that must load no
native code at all; a second those that load the C library, the intact cache last (its torch
operators stay registered); a build under umask 000 has a child of its own. A child stops at the
first scenario whose planted code ran, since that library stays loaded in it. The caches are filled
by `trusted.install` with this machine's build (copied, not compiled again), so they hold what a
build writes.
"""

import functools
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from quantlab.kernels import trusted
from quantlab.kernels.cpu import build, extension, native

CHILD = r"""
import copy, json, os, shutil, sys, warnings
import torch
import quantlab
from quantlab.kernels.cpu import extension, native, ops
from quantlab.testing.models import tiny_llama

SETTINGS = ("QUANTLAB_CACHE", "QUANTLAB_CPU_KERNELS", "QUANTLAB_TORCH_OPS", "PLANTED_MARKER")
results = {}
scenarios = json.loads(sys.argv[1])
for position, scenario in enumerate(scenarios):
    for name in SETTINGS:
        os.environ.pop(name, None)
    os.environ.update(scenario["env"])
    native._load.cache_clear()  # what a new process starts with
    extension.load.cache_clear()
    prebuilt = scenario.get("prebuilt")
    if prebuilt:  # a build into an empty cache copies this machine's libraries instead of compiling them
        assert callable(native._compile) and callable(extension._compile)
        native._compile = lambda cc, library: shutil.copyfile(prebuilt["kernels"], library)
        extension._compile = lambda cxx, output: shutil.copyfile(prebuilt["operators"], output)
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
    results[scenario["name"]] = {
        "native": loaded,
        "operators": operators,
        "warnings": [str(w.message) for w in caught if "native" in str(w.message)],
        "max_error": error,
    }
    if os.path.exists(scenario["env"]["PLANTED_MARKER"]):  # planted code is loaded for good: stop here
        for later in scenarios[position + 1 :]:
            results[later["name"]] = {"not run": f"planted code ran in the earlier scenario {scenario['name']!r}"}
        break
print(json.dumps(results))
"""

PAYLOAD = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(getenv("PLANTED_MARKER"), "w");
    if (marker) { fputs("planted code ran", marker); fclose(marker); }
}
"""


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("QUANTLAB_")}


@dataclass
class Scenario:
    """One prepared cache (or chosen library) and the settings a process loads it with."""

    name: str
    root: Path  # the QUANTLAB_CACHE folder
    marker: Path  # written by the planted library's constructor, if it ever runs
    env: dict[str, str] = field(default_factory=dict)
    prebuilt: dict[str, str] | None = None

    def as_json(self) -> dict:
        env = {"QUANTLAB_CACHE": str(self.root), "PLANTED_MARKER": str(self.marker), **self.env}
        return {"name": self.name, "env": env, "prebuilt": self.prebuilt}


def run_child(scenarios: list[Scenario], umask: int | None = None) -> dict[str, dict]:
    """Run the scenarios in order in one fresh process; each one's report, by name."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([scenario.as_json() for scenario in scenarios])],
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=None if umask is None else (lambda: os.umask(umask)),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def report(results: dict[str, dict], name: str) -> dict:
    assert "not run" not in results[name], results[name]["not run"]
    return results[name]


@dataclass
class Builds:
    """This machine's C library and operator extension, and a cache holding them as a build leaves it."""

    kernels: Path
    operators: Path
    template: Path  # a QUANTLAB_CACHE folder
    template_kernels: Path
    template_operators: Path

    def copy(self, root: Path) -> tuple[Path, Path]:
        """A private copy of the template cache at `root` (modes kept): (C library, operator extension)."""
        shutil.copytree(self.template, root, copy_function=shutil.copy2)
        return root / self.template_kernels.relative_to(self.template), root / self.template_operators.relative_to(
            self.template
        )

    def prebuilt(self) -> dict[str, str]:
        return {"kernels": str(self.kernels), "operators": str(self.operators)}


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> Builds:
    if native.compiler() is None:
        pytest.skip("no C compiler: nothing is built or loaded here")
    kernels, operators = native.build(), extension.build()  # compiled once per machine into the user's cache
    template = tmp_path_factory.mktemp("template") / "cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTLAB_CACHE", str(template))
        cached_kernels = native.library_path(native.compiler())
        cached_operators = extension.library_path(extension.cxx_compiler())
    for built, cached in ((kernels, cached_kernels), (operators, cached_operators)):
        trusted.install(functools.partial(shutil.copyfile, built), cached.parent, cached.name)
    return Builds(kernels, operators, template, cached_kernels, cached_operators)


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    """A library whose constructor writes `$PLANTED_MARKER`: proof that it was loaded."""
    folder = tmp_path_factory.mktemp("planted")
    source = folder / "planted.c"
    source.write_text(PAYLOAD)
    library = folder / "planted.so"
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


OPERATOR_CASES = [CASES[2], CASES[4], CASES[5]]  # its folder writable, replaced, a symlink


@pytest.fixture(scope="module")
def nothing_loads(builds, planted, tmp_path_factory) -> tuple[dict[str, dict], dict[str, Scenario]]:
    """Every scenario in which no native code may load, run in one child: each tampered cache, and a
    chosen library that others can write."""
    folder = tmp_path_factory.mktemp("nothing-loads")
    scenarios = {}
    for index, (case, tamper, _) in enumerate(CASES):
        root = folder / f"cache-{index}"
        library, _ = builds.copy(root)
        tamper(library, planted)
        scenarios[case] = Scenario(case, root, folder / f"marker-{index}")
    chosen = folder / "chosen.so"
    shutil.copyfile(planted, chosen)
    os.chmod(chosen, 0o777)
    env = {"QUANTLAB_CPU_KERNELS": str(chosen), "QUANTLAB_TORCH_OPS": "0"}
    scenarios["chosen writable"] = Scenario("chosen writable", folder / "cache-chosen", folder / "marker-chosen", env)
    return run_child(list(scenarios.values())), scenarios


@pytest.fixture(scope="module")
def c_library_loads(builds, planted, tmp_path_factory) -> tuple[dict[str, dict], dict[str, Scenario]]:
    """The scenarios that load the C library, run in one child: each tampered operator extension, the
    user's own chosen library, and last (its operators stay registered) the intact cache."""
    folder = tmp_path_factory.mktemp("c-library-loads")
    scenarios = {}
    for index, (case, tamper, _) in enumerate(OPERATOR_CASES):
        root = folder / f"cache-{index}"
        _, operators = builds.copy(root)
        tamper(operators, planted)
        scenarios[case] = Scenario(case, root, folder / f"marker-{index}")
    chosen = folder / "prebuilt" / "libquantlab_cpu.so"
    with (
        pytest.MonkeyPatch.context() as patch
    ):  # the command's own path, with this machine's build as the compiler's output
        patch.setattr(native, "_compile", lambda cc, library: shutil.copyfile(builds.kernels, library))
        assert build.main(["--output", str(chosen)]) == 0
    env = {"QUANTLAB_CPU_KERNELS": str(chosen), "QUANTLAB_TORCH_OPS": "0"}
    scenarios["chosen"] = Scenario("chosen", folder / "cache-chosen", folder / "marker-chosen", env)
    root = folder / "cache-intact"
    builds.copy(root)
    scenarios["intact"] = Scenario("intact", root, folder / "marker-intact")
    return run_child(list(scenarios.values())), scenarios


@pytest.mark.parametrize(("case", "tamper", "reason"), CASES, ids=[case[0] for case in CASES])
def test_tampered_cache_is_refused_and_the_model_stays_correct(nothing_loads, case, tamper, reason):
    results, scenarios = nothing_loads
    result, scenario = report(results, case), scenarios[case]
    assert not scenario.marker.exists(), "the planted library's code ran"
    assert not result["native"]
    [warning] = result["warnings"]
    assert "\n" not in warning and "refusing to load native code from" in warning and reason in warning
    assert str(scenario.root) in warning
    assert result["max_error"] <= 1e-5


def test_intact_cache_is_loaded(c_library_loads):
    results, _ = c_library_loads
    result = report(results, "intact")
    assert result["native"] and result["operators"] and result["warnings"] == []
    assert result["max_error"] <= 1e-4


@pytest.mark.parametrize(("case", "tamper", "reason"), OPERATOR_CASES, ids=[case[0] for case in OPERATOR_CASES])
def test_tampered_operator_extension_is_refused(c_library_loads, builds, case, tamper, reason):
    """The torch operators follow the same rule; refused, the layers call the verified C library through ctypes."""
    results, scenarios = c_library_loads
    result, scenario = report(results, case), scenarios[case]
    operators = scenario.root / builds.template_operators.relative_to(builds.template)
    assert not scenario.marker.exists(), "the planted library's code ran"
    assert result["native"] and not result["operators"]
    [warning] = result["warnings"]
    assert "torch operators are unavailable" in warning and str(operators.parent) in warning and reason in warning
    assert result["max_error"] <= 1e-4


def test_build_under_umask_000_is_private(builds, tmp_path):
    root = tmp_path / "new" / "cache"  # two parents to create as well
    scenario = Scenario("umask 000", root, tmp_path / "marker", prebuilt=builds.prebuilt())
    result = report(run_child([scenario], umask=0), "umask 000")
    assert result["native"] and result["operators"] and result["warnings"] == []
    created = [tmp_path / "new", *sorted((tmp_path / "new").rglob("*"))]
    modes = {path.relative_to(tmp_path).as_posix(): stat.S_IMODE(path.lstat().st_mode) for path in created}
    assert all(mode & 0o077 == 0 for mode in modes.values()), modes
    assert len([p for p in modes if p.endswith(".so")]) == 2 and [p for p in modes if p.endswith(".sha256")]
    assert not [p for p in modes if "build-" in p or "objects-" in p]  # no staging left behind


def test_chosen_library_writable_by_others_is_refused(nothing_loads):
    results, scenarios = nothing_loads
    result, scenario = report(results, "chosen writable"), scenarios["chosen writable"]
    chosen = scenario.env["QUANTLAB_CPU_KERNELS"]
    assert not scenario.marker.exists() and not result["native"]
    [warning] = result["warnings"]
    assert chosen in warning and "writable by group or others" in warning and "QUANTLAB_CPU_KERNELS" in warning
    assert result["max_error"] <= 1e-5


def test_chosen_library_of_the_user_is_loaded(c_library_loads):
    results, scenarios = c_library_loads
    result, scenario = report(results, "chosen"), scenarios["chosen"]
    assert stat.S_IMODE(Path(scenario.env["QUANTLAB_CPU_KERNELS"]).stat().st_mode) == 0o755
    assert result["native"] and not result["operators"] and result["warnings"] == []
    assert not scenario.root.exists()  # nothing built: the chosen library was used
