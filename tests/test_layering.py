"""quantlab's packages form layers: every import points down or sideways, and no packages import each other in a cycle.

A unit is a top-level module or subpackage of `quantlab` (`quantlab.eval`, `quantlab.loading`),
or the root package `quantlab` itself (the public API it re-exports). `LAYERS` lists every unit's
layer, bottom to top. A unit may import units of its own layer or of layers below it, never above.

Imports inside functions count too: deferring an import hides a cycle from the interpreter, not
from the design. They stay deferred only for their cost at `import quantlab` (an optional or heavy
dependency behind them) or for plugin discovery, and must point down like any other. Imports under
`if TYPE_CHECKING:` never run and only name types for annotations: they are not counted.

When a test here fails: move the code to the layer its dependencies allow (or split the module),
or, if the dependency is right and the declared order is wrong, move the unit in `LAYERS`.

The last checks run the code: a config followed from `quantlab.quantize` down to the storage format
passes at most `MAX_PLACES` quantlab functions and calls up into a higher layer at most `MAX_CLIMBS`
times (through an object handed down), so the recipe reads top to bottom.
"""

import ast
import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "quantlab"

LAYERS: list[tuple[str, set[str]]] = [
    ("foundation", {"quantlab.errors", "quantlab.utils", "quantlab.files"}),
    ("process groups", {"quantlab.distributed"}),
    ("bundled assets", {"quantlab.assets"}),
    ("storage formats", {"quantlab.formats"}),
    ("kernels", {"quantlab.kernels"}),
    ("solvers", {"quantlab.solvers"}),
    ("configs", {"quantlab.config"}),
    ("quantized modules", {"quantlab.nn"}),
    ("methods", {"quantlab.registry", "quantlab.methods", "quantlab.vocabulary", "quantlab.presets"}),
    ("model surgery", {"quantlab.replacement", "quantlab.verification", "quantlab.prune"}),
    ("calibration", {"quantlab.calibration"}),
    ("quantization plans", {"quantlab.plan"}),
    ("evaluation", {"quantlab.eval"}),
    ("library integrations", {"quantlab.integrations"}),
    ("conversion", {"quantlab.convert", "quantlab.interop"}),
    ("checkpoints", {"quantlab.loading", "quantlab.saving", "quantlab.streaming"}),
    ("decoding", {"quantlab.generation"}),
    ("public API", {"quantlab"}),
    ("training", {"quantlab.training"}),
    ("distillation", {"quantlab.distill", "quantlab.qat"}),
    ("runtimes", {"quantlab.export"}),
    ("test helpers", {"quantlab.testing"}),
    ("workflows", {"quantlab.workflows"}),
    ("command line", {"quantlab.cli", "quantlab.__main__"}),
]
LAYER_OF = {unit: index for index, (_, units) in enumerate(LAYERS) for unit in units}


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing unit
    target: str  # the imported unit
    where: str  # path:line of the import statement


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def unit_of(module: str) -> str:
    """`quantlab.a.b.c` belongs to `quantlab.a`; the root package is its own unit."""
    return ".".join(module.split(".")[:2])


def imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The quantlab modules an import statement loads (`from quantlab import registry` loads `quantlab.registry`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
    return submodules or [base]


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def statements(nodes: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in `nodes`, at any depth, less the bodies of `if TYPE_CHECKING:`."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and is_type_checking(node):
            yield from statements(node.orelse)
        else:
            yield from statements(ast.iter_child_nodes(node))


def quantlab_imports() -> list[Import]:
    """Every import of one quantlab unit by another, with where it is."""
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in statements([tree]):
            for target in imported_modules(node, module, path.name == "__init__.py"):
                if target != "quantlab" and not target.startswith("quantlab."):
                    continue
                source_unit, target_unit = unit_of(module), unit_of(target)
                if source_unit != target_unit:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    found.append(Import(source_unit, target_unit, where))
    return found


def test_every_unit_has_a_layer():
    undeclared = sorted({unit_of(module) for module in MODULES} - set(LAYER_OF))
    assert not undeclared, f"add these units of quantlab to LAYERS in {Path(__file__).name}: {', '.join(undeclared)}"


def test_imports_point_down():
    upward = [
        f"{i.where}: {i.source} (layer {LAYERS[LAYER_OF[i.source]][0]!r}) imports {i.target} "
        f"(layer {LAYERS[LAYER_OF[i.target]][0]!r}, above it)"
        for i in quantlab_imports()
        if i.source in LAYER_OF and i.target in LAYER_OF and LAYER_OF[i.target] > LAYER_OF[i.source]
    ]
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_no_cycle_between_units():
    edges: dict[str, dict[str, str]] = {}
    for i in quantlab_imports():
        edges.setdefault(i.source, {}).setdefault(i.target, i.where)
    cycle = find_cycle(edges)
    assert cycle is None, "units that import each other in a cycle:\n" + "\n".join(
        f"{a} -> {b} ({edges[a][b]})" for a, b in itertools.pairwise(cycle)
    )


def find_cycle(edges: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None when it has none (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for successor in sorted(edges.get(node, {})):
            if state.get(successor) == "open":
                return [*path[path.index(successor) :], successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_checks_see_what_they_check():
    """The parser finds deferred imports, skips TYPE_CHECKING ones, and the cycle search finds a cycle."""
    tree = ast.parse(
        "import quantlab.a\nif TYPE_CHECKING:\n    import quantlab.b\nelse:\n    import quantlab.c\n"
        "def f():\n    from quantlab import d\n    class C:\n        import quantlab.e\n"
    )
    found = [imported_modules(node, "quantlab.x", False)[0] for node in statements([tree])]
    assert found == ["quantlab.a", "quantlab.c", "quantlab", "quantlab.e"]
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}}) is None


# -- a config's path from `quantize` down to the storage format ------------------------------------

PATH_START = ("quantlab.convert", "quantize")
PATH_ENDS = ("quantlab.formats", "quantlab.kernels")  # where the weights become codes (or kernels run)
MAX_PLACES, MAX_CLIMBS = 20, 4


def deepest_path(run, start: tuple[str, str] = PATH_START) -> list[tuple[str, str]]:
    """The longest chain of quantlab functions on the stack, from `start` to a call into `PATH_ENDS`,
    while `run()` runs: (module, function) from the outermost."""
    import sys

    deepest: list[tuple[str, str]] = []

    def chain(frame) -> list[tuple[str, str]]:
        names = []
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("quantlab"):
                names.append((module, frame.f_code.co_qualname))
            frame = frame.f_back
        names.reverse()
        return names[names.index(start) :] if start in names else []

    def profile(frame, event, _arg) -> None:
        nonlocal deepest
        if event == "call" and frame.f_globals.get("__name__", "").startswith(PATH_ENDS):
            found = chain(frame)
            deepest = found if len(found) > len(deepest) else deepest

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return deepest


def climbs(path: list[tuple[str, str]]) -> int:
    """Calls from a unit into a unit of a higher layer (the code climbing back up the architecture)."""
    layers = [LAYER_OF[unit_of(module)] for module, _ in path]
    return sum(later > earlier for earlier, later in itertools.pairwise(layers))


@pytest.mark.parametrize("solver", ["rtn", "gptq"])
def test_a_config_reaches_the_format_in_few_places_and_never_climbs_far(solver: str) -> None:
    import torch

    import quantlab
    from quantlab.testing import tiny_llama

    options = {"solver": solver, "calibration_samples": 2, "calibration_seq_len": 16} if solver != "rtn" else {}
    config = quantlab.CustomBitsConfig(bits=4, group_size=32, **options)
    model, ids = tiny_llama(0), torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    path = deepest_path(lambda: quantlab.quantize(model, config, calibration=ids, progress=False))

    assert path and path[-1][0].startswith(PATH_ENDS), path
    described = " -> ".join(f"{module}.{function}" for module, function in path)
    assert len(path) <= MAX_PLACES, described
    assert climbs(path) <= MAX_CLIMBS, described


def test_the_path_check_sees_a_climb() -> None:
    path = [("quantlab.convert", "quantize"), ("quantlab.formats.layout", "f"), ("quantlab.nn.x", "g")]
    assert climbs(path) == 1 and climbs(path[:2]) == 0
