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


# ----------------------------------------------- who writes an inference's attributes
# The engine (engine.py) owns a fit's attributes and the record type (record.py) its record:
# nothing else assigns an inference's attributes, not even its own while it is built. A
# method's __init__ hands its config (and initial particles) to FlowInference.__init__, and
# its _initialise returns what it decided (pymc_gpf.protocols.Initialised: q, the resolved
# options, the structure, its own state in one object whose fields it then updates), which
# the engine assigns.
OWNERS = {"engine.py", "record.py"}


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}


def _inference_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """FlowInference and the classes deriving from it, in any module of the package."""
    names, grew = {"FlowInference"}, True
    while grew:
        grew = False
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in names:
                    bases = {getattr(b, "id", getattr(b, "attr", None)) for b in node.bases}
                    if bases & names:
                        names.add(node.name)
                        grew = True
    return names


def _stored(node: ast.AST) -> list[ast.Attribute]:
    """The attributes an assignment (plain, augmented, annotated; tuples too) or a
    ``setattr(x, ...)`` stores to (the latter as ``x.<setattr>``)."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
        return [ast.Attribute(node.args[0], "<setattr>", ast.Store())]
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    return [
        e for t in targets for e in ast.walk(t)
        if isinstance(e, ast.Attribute) and isinstance(e.ctx, ast.Store)
    ]  # fmt: skip


def _inference_names(function: ast.AST, classes: set[str]) -> set[str]:
    """Names in ``function`` that hold an inference: parameters called ``inference`` or
    annotated with an inference class, and names bound to a call of one (``gf = GF(...)``)."""
    names = set()
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        for arg in [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]:
            annotation = ast.unparse(arg.annotation) if getattr(arg, "annotation", None) else ""
            if arg.arg == "inference" or any(c in annotation.split(" | ") for c in classes):
                names.add(arg.arg)
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            called = node.value.func
            if getattr(called, "id", getattr(called, "attr", None)) in classes:
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _writes_to_inferences(path: Path, tree: ast.Module, classes: set[str]) -> list[str]:
    found = []
    inside_inference = {
        id(fn): cls.name
        for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) and cls.name in classes
        for fn in cls.body if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    }  # fmt: skip
    functions = [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    for function in functions:
        holders = _inference_names(function, classes)
        owner = inside_inference.get(id(function))
        if owner is not None:
            holders.add("self")
        for node in ast.walk(function):
            for attribute in _stored(node):
                value = attribute.value
                held = isinstance(value, ast.Name) and value.id in holders
                # approx.inference.x = ...
                held = held or (isinstance(value, ast.Attribute) and value.attr == "inference")
                if held:
                    where = f"{owner}.{function.name}" if owner else function.name
                    found.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {where} assigns "
                        f"{ast.unparse(attribute)}"
                    )
    return sorted(set(found))


def inference_writes(trees: dict[Path, ast.Module]) -> list[str]:
    """Assignments to an inference's attributes outside the engine and the record type
    (an inference's own included, in any of its methods)."""
    classes = _inference_classes(trees)
    found = []
    for path, tree in trees.items():
        if path.parent == PACKAGE and path.name in OWNERS:
            continue
        found += _writes_to_inferences(path, tree, classes)
    return found


def test_only_the_engine_writes_an_inference_attributes():
    assert inference_writes(_trees()) == []


def test_the_write_check_sees_writes():
    trees = _trees()
    gpf = PACKAGE / "gpf" / "method.py"
    planted = gpf.read_text()
    for where, line in [
        ("    def _fitted_settings(self) -> dict:\n", "        self.n_seen = 1\n"
         "        self.approx.inference.x, y = 2, 3\n        gf = GF()\n        gf.state += 1\n"),
        # while it is built too: the engine assigns what __init__ hands over and
        # _initialise returns
        ("    def _initialise(self) -> Initialised:\n", "        self.structure = None\n"),
        ("        jitter: float | None = None,\n    ):\n", "        self.initial_particles = 1\n"),
    ]:  # fmt: skip
        assert planted.count(where) == 1
        planted = planted.replace(where, where + line)
    trees[gpf] = ast.parse(planted)
    found = "\n".join(inference_writes(trees))
    assert "GPF._fitted_settings assigns self.n_seen" in found
    assert "assigns self.approx.inference.x" in found
    assert "assigns gf.state" in found
    assert "GPF._initialise assigns self.structure" in found
    assert "GPF.__init__ assigns self.initial_particles" in found
    # module-level functions writing to a parameter named inference, or annotated as one
    trees[PACKAGE / "planted.py"] = ast.parse(
        "def f(inference):\n    inference.done = True\n"
        "def g(fit: GPF | None):\n    setattr(fit, 'n', 1)\n"
    )
    found = "\n".join(inference_writes(trees))
    assert "f assigns inference.done" in found and "g assigns fit.<setattr>" in found
