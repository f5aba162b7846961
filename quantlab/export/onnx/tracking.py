"""Naming the module an exporter failure comes from, instead of showing the exporter's traceback."""

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules import module as module_hooks


class ModuleTracker:
    """Records which submodules are running; after an exception `innermost` is the one that raised."""

    def __init__(self, model: nn.Module, prefix: str = "") -> None:
        self.names = {id(m): name.removeprefix(prefix) for name, m in model.named_modules()}
        self.stack: list[str] = []

    def _enter(self, module: nn.Module, args) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.stack.append(name)

    def _exit(self, module: nn.Module, args, output) -> None:
        name = self.names.get(id(module))
        if name is not None and self.stack and self.stack[-1] == name:
            self.stack.pop()

    @property
    def innermost(self) -> str | None:
        named = [name for name in self.stack if name]
        return named[-1] if named else None

    @contextlib.contextmanager
    def active(self) -> Iterator["ModuleTracker"]:
        self.stack.clear()
        handles = [
            module_hooks.register_module_forward_pre_hook(self._enter),
            module_hooks.register_module_forward_hook(self._exit),
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def module_of_failed_node(program: torch.export.ExportedProgram, error: BaseException, prefix: str = "") -> str | None:
    """The module whose FX node an ONNX conversion error names, if it can be found.

    The exporter decomposes the program before translating it, so the failing node may carry
    a new name (`%zeta` for `aten.special_zeta`): it is looked up by name, then by operator.
    """
    match = re.search(r"Error when translating node %(\S+) .*?target=([\w.]+)", _full_message(error))
    if match is None:
        return None
    name, target = match.groups()
    operator = target.split(".")[-2] if target.count(".") >= 2 else target
    nodes = [node for node in program.graph.nodes if node.op == "call_function"]
    candidates = [node for node in nodes if node.name == name] or [
        node for node in nodes if operator in str(node.target)
    ]
    for node in candidates:
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            return list(stack.values())[-1][0].removeprefix(prefix) or None
    return None


def short_reason(error: BaseException) -> str:
    """The most specific line of an exporter error (the innermost cause's first line)."""
    innermost = error
    while innermost.__cause__ is not None:
        innermost = innermost.__cause__
    summary = re.search(r"## Exception summary\s+(.+?)(?:\n\n|$)", str(error), re.S)
    text = summary.group(1) if summary else str(innermost)
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("⬆")]
    if not lines:
        return type(innermost).__name__
    return re.sub(r"^<class '[\w.]+'>: ", "", lines[0])[:400]


def _full_message(error: BaseException) -> str:
    parts = []
    while error is not None:
        parts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(parts)
