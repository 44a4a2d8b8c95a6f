"""The package's layout keeps its rules: no import circle, a worker side free of
torch and the builder, tools the library never imports, an index of
``dispatch/`` that matches its files, and old module paths that still import."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import centralpipe
from centralpipe import _moved
from centralpipe.dispatch.executors.preload import WORKER_MODULE

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "centralpipe"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


#: Every module of the package, by name.
MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _module_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements run when the module is imported: top-level ones,
    including those in top-level ``if``/``try`` blocks, not ``if TYPE_CHECKING``."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            yield from _module_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            handlers = [s for h in node.handlers for s in h.body]
            yield from _module_level(node.body + handlers + node.orelse + node.finalbody)


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The full names ``node`` (in module ``name``) imports; a ``from`` import
    of a submodule names the submodule."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parent, base] if base else parent)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _imports(name: str, *, module_level: bool = True) -> set[str]:
    """What module ``name`` imports (full names, inside the package or not)."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    if module_level:
        nodes: list[ast.Import | ast.ImportFrom] = list(_module_level(tree.body))
    else:
        nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    return {full for node in nodes for full in _imported(name, node)}


def _edges(name: str, *, module_level: bool = True) -> set[str]:
    """The package's modules that importing ``name`` runs first: each imported
    module and the packages above it (not ``name``'s own packages). With
    ``module_level=False``, also those its functions and ``if TYPE_CHECKING``
    blocks import: what it depends on at all."""
    out = set()
    for full in _imports(name, module_level=module_level):
        parts = full.split(".")
        for i in range(1, len(parts) + 1):
            target = ".".join(parts[:i])
            if target in MODULES and target != name and not name.startswith(target + "."):
                out.add(target)
    return out


GRAPH = {name: _edges(name) for name in MODULES}
#: Every dependency, imports inside functions and for type checking included.
ANY_LEVEL = {name: _edges(name, module_level=False) for name in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path (first == last), or ``None``."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def _closure(start: str) -> set[str]:
    """``start`` and every module of the package that importing it runs."""
    seen = {start}
    todo = [start]
    while todo:
        for nxt in GRAPH[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        pytest.param({"a": {"b"}, "b": {"c"}, "c": set()}, None, id="chain"),
        pytest.param({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"], id="two"),
        pytest.param(
            {"a": {"b"}, "b": {"c"}, "c": {"d", "b"}, "d": set()}, ["b", "c", "b"], id="inner"
        ),
        pytest.param({"a": {"a"}}, ["a", "a"], id="self"),
    ],
)
def test_cycle_finder(graph: dict[str, set[str]], expected: list[str] | None) -> None:
    """The circle finder reports the circle it finds as a closed path."""
    assert _cycle(graph) == expected


def test_the_package_has_no_import_circle() -> None:
    """No module of the package imports, at module level, a module that
    imports it back (through any number of others, parent packages included)."""
    found = _cycle(GRAPH)
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_no_module_depends_on_itself_through_any_import() -> None:
    """No module depends on itself through others, counting the imports made
    inside functions and for type checking too (a deferred import hides a
    circle of ownership, it does not remove it): each circle is named."""
    found = _cycle(ANY_LEVEL)
    assert found is None, "import circle (any level): " + " -> ".join(found or [])


def test_the_any_level_graph_counts_deferred_and_type_checking_imports() -> None:
    """The any-level analysis sees an import inside a function and one under
    ``if TYPE_CHECKING`` (what the circle test relies on)."""
    deferred = _imports("centralpipe.plan.sources", module_level=False)
    assert "torchdata.nodes" in deferred
    assert "torchdata.nodes" not in _imports("centralpipe.plan.sources")
    assert "centralpipe.plan.specs" in ANY_LEVEL["centralpipe.stages.base"]
    assert "centralpipe.plan.specs" not in GRAPH["centralpipe.stages.base"]


def test_stage_modules_import_only_the_specs_of_the_builder() -> None:
    """The central stages know the plan by its specs, kinds and typed options: no module of
    ``stages/`` imports the builder (``plan.pipeline``, its checks, its
    sources or ``mix``'s spec), at any level."""
    plan_side = {
        "centralpipe.plan",
        "centralpipe.plan.specs",
        "centralpipe.plan.kinds",
        "centralpipe.plan.options",
    }
    found = sorted(
        f"{name} imports {target}"
        for name in MODULES
        if name.startswith("centralpipe.stages")
        for target in ANY_LEVEL[name]
        if target.startswith("centralpipe.plan") and target not in plan_side
    )
    assert found == []


def test_the_worker_side_imports_neither_torch_nor_the_builder() -> None:
    """The worker loop and everything it imports inside the package import no
    torch, no builder (``plan.pipeline``), no central stage and no Loader; of
    ``plan`` only the specs, which a worker unpickles, the per-item kinds
    they name and the typed options they hold."""
    assert WORKER_MODULE == "centralpipe.dispatch.worker.loop"
    side = _closure(WORKER_MODULE)
    torch = sorted(m for m in side if any(i.split(".")[0] == "torch" for i in _imports(m)))
    assert torch == []
    allowed_plan = {
        "centralpipe.plan",
        "centralpipe.plan.specs",
        "centralpipe.plan.kinds",
        "centralpipe.plan.options",
    }
    builder = sorted(
        m
        for m in side
        if (m.startswith("centralpipe.plan") and m not in allowed_plan)
        or m.startswith("centralpipe.stages")
        or m in ("centralpipe.loader", "centralpipe.config")
    )
    assert builder == []


def test_the_library_never_imports_the_tools() -> None:
    """Nothing outside ``centralpipe.tools`` (and the command line) imports a
    module of it, at any level; the tools hold the bench and the soak."""
    assert {"centralpipe.tools.bench", "centralpipe.tools.soak"} <= set(MODULES)
    found = sorted(
        f"{name} imports {full}"
        for name in MODULES
        if not (name.startswith("centralpipe.tools") or name == "centralpipe.__main__")
        for full in _imports(name, module_level=False)
        if full == "centralpipe.tools" or full.startswith("centralpipe.tools.")
    )
    assert found == []


def test_the_loader_reaches_dispatch_only_through_its_central_object() -> None:
    """``loader.py`` imports one module of ``dispatch/``, the narrow central
    object (start, next, state, load, query, metrics, stop, close), at any level."""
    found = sorted(
        full
        for full in _imports("centralpipe.loader", module_level=False)
        if full.startswith("centralpipe.dispatch")
    )
    assert found == ["centralpipe.dispatch.central"]


#: One entry of ``dispatch/__init__.py``'s index: ``- ``name`` [worker] text``.
ENTRY = re.compile(r"^- ``([a-z_.]+)``\s+(\[worker\])?", re.M)


def _index() -> dict[str, bool]:
    doc = ast.get_docstring(ast.parse((PACKAGE / "dispatch" / "__init__.py").read_text()))
    assert doc is not None
    return {m.group(1): bool(m.group(2)) for m in ENTRY.finditer(doc)}


def test_the_dispatch_index_lists_exactly_its_modules() -> None:
    """``dispatch/__init__.py`` names every module under ``dispatch/`` once
    (relative name, packages' ``__init__`` aside), and no module that is not there."""
    present = sorted(
        name.removeprefix("centralpipe.dispatch.")
        for name, path in MODULES.items()
        if name.startswith("centralpipe.dispatch.") and path.name != "__init__.py"
    )
    assert sorted(_index()) == present


def test_the_dispatch_index_says_which_modules_run_in_workers() -> None:
    """The modules the index marks ``[worker]`` are exactly those of
    ``dispatch/`` that the worker loop runs (itself and what it imports)."""
    side = sorted(
        m.removeprefix("centralpipe.dispatch.")
        for m in _closure(WORKER_MODULE)
        if m.startswith("centralpipe.dispatch.") and MODULES[m].name != "__init__.py"
    )
    assert sorted(name for name, worker in _index().items() if worker) == side


def _fresh(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Forget module ``name`` (and the attribute on its parent) for this test."""
    monkeypatch.delitem(sys.modules, name, raising=False)
    parent, _, child = name.rpartition(".")
    if hasattr(sys.modules[parent], child) and child in vars(sys.modules[parent]):
        monkeypatch.delattr(sys.modules[parent], child)


@pytest.mark.parametrize(("old", "new"), sorted(_moved.MOVED.items()), ids=sorted(_moved.MOVED))
def test_an_old_module_path_imports_the_moved_module(
    monkeypatch: pytest.MonkeyPatch, old: str, new: str
) -> None:
    """An old path gives the module at its new path (the same object, its own
    spec kept), with a ``DeprecationWarning`` naming the new path; no file is
    left at the old path."""
    parent, _, child = old.rpartition(".")
    assert importlib.machinery.PathFinder.find_spec(child, sys.modules[parent].__path__) is None
    _fresh(monkeypatch, old)
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} has moved to {new}: "):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new
    assert module.__spec__ is not None and module.__spec__.name == new


@pytest.mark.parametrize(("path", "home"), sorted(_moved.PUBLIC.items()), ids=sorted(_moved.PUBLIC))
def test_a_documented_path_imports_its_module_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, path: str, home: str
) -> None:
    """A documented path whose module lives elsewhere imports it silently."""
    _fresh(monkeypatch, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = importlib.import_module(path)
    assert module is importlib.import_module(home)


def test_an_unknown_module_path_is_still_not_found() -> None:
    """The finder answers only for its table: any other path fails as before."""
    with pytest.raises(ModuleNotFoundError, match=r"'centralpipe\.no_such_module'"):
        importlib.import_module("centralpipe.no_such_module")


def test_the_public_progress_is_the_function() -> None:
    """``cp.progress`` is the function and no submodule shares its name."""
    assert importlib.machinery.PathFinder.find_spec("progress", centralpipe.__path__) is None
    assert callable(centralpipe.progress)
    assert centralpipe.progress.__module__ == "centralpipe.integrations.progress"


def test_no_module_imports_another_modules_private_names() -> None:
    """A module imports only the public names of the package's other modules
    (a private module, such as ``_moved``, is imported whole)."""
    found = sorted(
        f"{name}:{node.lineno} imports {alias.name} from {node.module}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("centralpipe")
        for alias in node.names
        if alias.name.startswith("_") and f"{node.module}.{alias.name}" not in MODULES
    )
    assert found == []


def test_no_module_or_test_imports_an_old_path() -> None:
    """The package and its tests import every moved module from its new path
    (an old one still works, with a warning, for code outside)."""
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                for name in names
                if name in _moved.MOVED or any(name.startswith(f"{m}.") for m in _moved.MOVED)
            ]
    assert found == []


def test_the_supervisor_knows_the_executors_by_their_interface() -> None:
    """``dispatch.supervisor`` imports the executors' shared interface only,
    never one executor (processes or threads)."""
    executors = sorted(
        full
        for full in _imports("centralpipe.dispatch.supervisor", module_level=False)
        if full.startswith("centralpipe.dispatch.executors")
    )
    assert executors == ["centralpipe.dispatch.executors.pool"]
