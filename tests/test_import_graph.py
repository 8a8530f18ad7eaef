"""No import circles among the project's own modules.

The graph is read from the source, not from ``sys.modules``: every ``import`` and ``from … import`` anywhere in a
module counts, a function-local one included (an import hidden in a function that closes a circle is still a
circle), except those under ``if TYPE_CHECKING:``. ``from pkg import name`` is an edge to ``pkg.name`` when that is a
module, else to ``pkg``; importing a package is an edge to its ``__init__`` only, not to its submodules (a
name that is no module is an edge to the nearest module above it). The circles are the strongly connected
components of that graph (Tarjan's algorithm).
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("swarmserve", "swarm_client", "worker", "gateway", "load_tests")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``node``, at any depth, except in the bodies of ``if TYPE_CHECKING:``."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
        return
    typing_only = isinstance(node, ast.If) and _is_type_checking(node.test)
    for child in node.orelse if typing_only else ast.iter_child_nodes(node):
        yield from _import_nodes(child)


def _nearest_module(name: str, modules: Collection[str]) -> str | None:
    """``name`` if it is one of ``modules``, else its longest prefix that is (``a.b.attr`` → ``a.b``)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def _imports(tree: ast.AST, module: str, is_package: bool, modules: Collection[str]) -> set[str]:
    """The ``modules`` that ``module`` (parsed as ``tree``) imports, itself left out."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    found = {_nearest_module(name, modules) for name in names}
    return {m for m in found if m is not None and m != module}


@cache
def _graph() -> dict[str, set[str]]:
    """module → the project modules it imports."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {
        name: _imports(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", files)
        for name, path in files.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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


def _deepest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports (each module imports the next), counted on the graph without its circles."""
    cyclic = {m for component in _cycles(graph) for m in component}
    longest: dict[str, list[str]] = {}

    def chain(module: str) -> list[str]:
        if module not in longest:
            longest[module] = [module]  # guards against what circles are left
            below = [chain(t) for t in sorted(graph[module]) if t not in cyclic]
            longest[module] = [module, *max(below, key=len, default=[])]
        return longest[module]

    return max((chain(m) for m in sorted(graph) if m not in cyclic), key=len)


def _cycles_in(*packages: str) -> list[list[str]]:
    graph = _graph()
    return [c for c in _cycles(graph) if any(m.split(".")[0] in packages for m in c)]


def _describe(cycles: list[list[str]]) -> str:
    return "import circles:\n" + "\n".join("  " + " ↔ ".join(c) for c in cycles)


def test_imports_are_read_as_python_runs_them() -> None:
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.sub", "pkg.sub.d", "pkg.typed", "pkg.e", "pkg.f"}
    source = """
from typing import TYPE_CHECKING
import os
from pkg import a, CONSTANT
from .sub import d
from .. import outside
from pkg.b import name

if TYPE_CHECKING:
    from pkg import typed
else:
    import pkg.e

def late():
    from pkg.c import thing  # a function-local import is an edge too
    import pkg.f.attribute
"""
    found = _imports(ast.parse(source), "pkg.mod", False, modules)
    assert found == {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.sub.d", "pkg.e", "pkg.f"}
    assert _imports(ast.parse("from . import a\nfrom .sub import d"), "pkg", True, modules) == {"pkg.a", "pkg.sub.d"}


def test_graph_sees_the_project() -> None:
    graph = _graph()
    assert "swarm_client.sequence_manager" in graph["swarm_client.session"]
    assert "swarm_client.errors" in graph["swarm_client"]  # a package: its __init__
    chain = _deepest_chain(graph)
    print(f"import levels: {len(chain)} (deepest chain: {' → '.join(chain)})")


def test_cycle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["d", "e"]]


def test_library_worker_and_command_line_have_no_import_cycles() -> None:
    cycles = _cycles_in("swarm_client", "worker", "swarmserve", "load_tests")
    assert not cycles, _describe(cycles)


def test_gateway_has_no_import_cycles() -> None:
    cycles = _cycles_in("gateway")
    assert not cycles, _describe(cycles)
