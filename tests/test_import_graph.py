"""The rooms of DESIGN.md as the imports draw them: no module-level import cycle in rayinfer, and
the host side of the engine (and everything below it) imports nothing of the rooms above it.

Read from the source with `ast` (nothing is imported): a module-level `import` or `from ...
import` names an edge; imports inside functions and under `if TYPE_CHECKING:` do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "rayinfer"

# room -> the rooms above it, which it must not import
NOT_ABOVE = {
    "rayinfer.kernels": ("rayinfer.layers", "rayinfer.models", "rayinfer.engine"),
    "rayinfer.comm": ("rayinfer.layers", "rayinfer.models", "rayinfer.engine"),
    "rayinfer.layers": ("rayinfer.models", "rayinfer.engine", "rayinfer.workers"),
    "rayinfer.models": ("rayinfer.engine", "rayinfer.workers", "rayinfer.deployments"),
    "rayinfer.engine": ("rayinfer.workers", "rayinfer.deployments", "rayinfer.llm"),
    "rayinfer.llm": ("rayinfer.deployments", "rayinfer.app"),
    "rayinfer.workers.runner": (
        "rayinfer.engine.scheduler",
        "rayinfer.engine.block_manager",
        "rayinfer.engine.engine",
        "rayinfer.deployments",
    ),
}


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def module_level_imports(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            yield from module_level_imports(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            handlers = [stmt for handler in node.handlers for stmt in handler.body]
            yield from module_level_imports(node.body + handlers + node.orelse + node.finalbody)


def imported_modules(node: ast.Import | ast.ImportFrom, modules: dict) -> set[str]:
    """The rayinfer modules an import statement names (a submodule where one is imported)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        named = [f"{base}.{alias.name}" for alias in node.names]
        targets = [name if name in modules else base for name in named]
    found = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target:
            found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_names()
    edges = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        edges[name] = set().union(
            *(imported_modules(node, modules) for node in module_level_imports(tree.body))
        ) - {name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_level_import_cycle(graph):
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("room", sorted(NOT_ABOVE))
def test_a_room_imports_nothing_above_it(graph, room):
    def inside(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if inside(module, room)
        for target in targets
        if any(inside(target, above) for above in NOT_ABOVE[room])
    )
    assert wrong == []
