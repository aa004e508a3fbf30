"""The package's import structure: imports only point down (no cycles) and no module imports
the package inside a function (optional dependencies may be imported late)."""

from __future__ import annotations

import ast

from graphlib import CycleError, TopologicalSorter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pymc_gpf"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import of the package."""
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            # "from pymc_gpf.gpf import flow" imports the module pymc_gpf.gpf.flow
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "pymc_gpf" or name.startswith("pymc_gpf."):
                found.append((name, id(node) in top))
    return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph, late = {}, []
    for name, path in modules.items():
        deps = set()
        for imported, at_top in _imports(ast.parse(path.read_text())):
            if not at_top:
                late.append(f"{name} imports {imported} inside a function or block")
            # a module, or a name defined in one ("pymc_gpf.engine.FlowInference")
            target = imported if imported in modules else imported.rpartition(".")[0]
            if target in modules and target != name:
                deps.add(target)
        graph[name] = deps
    return graph, late


def test_no_function_level_imports_of_the_package():
    _, late = _graph()
    assert late == []


def test_imports_only_point_down():
    graph, _ = _graph()
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as err:
        raise AssertionError(f"circular imports: {err.args[1]}") from None
    assert set(order) == set(graph)
    assert "pymc_gpf.engine" in graph["pymc_gpf.approximation"]  # the check sees edges
