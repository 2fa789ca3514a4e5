"""No import cycles among the project's modules.

Checked against: the source of ``vlpe/``, ``models/``, ``data/``, ``train/`` and ``eval/`` as ``ast`` reads it
(nothing is imported). Every ``import`` and ``from ... import`` counts, at module level and inside functions,
classes and ``if TYPE_CHECKING:`` blocks alike; relative imports are resolved against the importing module's
package, and ``eval/``'s bare-name imports (``import runs``, as its scripts run with ``eval/`` on the path)
resolve to the ``eval`` modules. An edge goes to the module a statement names: ``from pkg import name`` reaches
``pkg.name`` where that is a module and ``pkg`` otherwise, and importing ``a.b.c`` is not counted as importing ``a``
and ``a.b`` (their ``__init__`` runs first, but a package's ``__init__`` importing its own submodules is the normal
layout). A submodule importing its parent package back therefore closes a cycle, as does any other loop; the
strongly connected components of the graph (Tarjan) must all be single modules, and the test names every cycle it
finds.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("vlpe", "models", "data", "train", "eval")


def module_name(path: Path) -> str:
    """The dotted name of a source file under ``ROOT`` (a package's ``__init__.py`` is the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every module of the five trees, by dotted name (``eval/`` has no ``__init__.py``: its files are ``eval.*``)."""
    modules = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            if "__pycache__" not in path.parts:
                modules[module_name(path)] = path
    return modules


def _resolve(dotted: str, importer: str, modules: dict[str, Path]) -> str | None:
    """The project module ``dotted`` names, seen from ``importer`` (``None`` for anything outside the project)."""
    if dotted in modules:
        return dotted
    if importer.startswith("eval.") and f"eval.{dotted}" in modules:
        return f"eval.{dotted}"
    return None


def _target(dotted: str, importer: str, modules: dict[str, Path]) -> str | None:
    """The module an ``import dotted`` reaches: the longest prefix of ``dotted`` that is a project module."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        found = _resolve(".".join(parts[:end]), importer, modules)
        if found is not None:
            return found
    return None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that ``name`` (the file ``path``) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(_target(alias.name, name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                sub = _resolve(f"{base}.{alias.name}", name, modules) if alias.name != "*" else None
                found.add(sub if sub is not None else _target(base, name, modules))
    found.discard(None)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each project module and the project modules it imports."""
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
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
                    components.append(sorted(component))
    return sorted(components)


def a_cycle(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One shortest loop through the component, from its first module back to it (breadth-first)."""
    start, members = component[0], set(component)
    previous = {start: start}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return component


def test_the_graph_sees_every_tree_and_resolves_relative_and_bare_imports():
    """The graph holds modules of all five trees, and the edges of known imports are where they should be
    (relative, package-relative to a submodule, ``eval/``'s bare names, inside a function), so that an empty result
    means no cycle, not no edges."""
    graph = import_graph()
    assert {name.split(".")[0] for name in graph} == set(TREES)
    assert "vlpe.encodings.base" in graph["vlpe.encodings.rope"]  # from .base import ...
    assert {"vlpe.encodings", "vlpe.testing"} <= graph["vlpe"]  # from . import encodings / testing
    assert "eval.runs" in graph["eval.long_video"]  # from runs import pick_device
    assert "eval.long_video_report" in graph["eval.hf_long_video"]  # inside evaluate_hf
    assert "models.vit_timm" in graph["models.vit"] and "models.vit" not in graph["models.vit_timm"]


def test_cycles_are_found_and_named():
    """Tarjan's components on a small graph: a two-module loop and a three-module loop are found, a module that
    only reaches a loop is not part of it, and each loop is named from its first module back to it."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a", "d"}, "d": {"e"}, "e": {"f"}, "f": {"d"}, "g": set()}
    assert strongly_connected(graph) == [["a", "b"], ["d", "e", "f"]]
    assert a_cycle(["d", "e", "f"], graph) == ["d", "e", "f", "d"]
    assert a_cycle(["a", "b"], graph) == ["a", "b", "a"]


def test_no_import_cycles():
    """No strongly connected component of the import graph has more than one module; each one found is named with
    one of its loops."""
    graph = import_graph()
    cycles = strongly_connected(graph)
    report = "\n".join(f"{' <-> '.join(c)}\n    e.g. {' -> '.join(a_cycle(c, graph))}" for c in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s):\n{report}"


TRAINING_SCRIPTS = ("train.vit", "train.vlm", "train.points")


def test_eval_imports_no_training_script():
    """The evaluations rebuild a run from what it is made of (``train/*_setup.py``: config, datasets, batches) and
    the model builders of ``models/``; a training script (an entry point) is imported by none of them."""
    graph = import_graph()
    assert set(TRAINING_SCRIPTS) <= set(graph)
    assert "train.vit_setup" in graph["eval.resolution"] and "models.vit" in graph["eval.runs"]
    found = {name: sorted(graph[name] & set(TRAINING_SCRIPTS)) for name in graph if name.startswith("eval.")}
    found = {name: scripts for name, scripts in found.items() if scripts}
    assert not found, f"eval/ imports training scripts: {found}"


#: modules of ``vlpe/`` allowed to import a module outside ``vlpe/`` (the harness: models, data, train, eval), each
#: with the modules it imports; none today. The wheel ships ``vlpe/`` alone, so any other import of the harness
#: fails for every user of the installed library.
KNOWN_HARNESS_IMPORTS: dict[str, list[str]] = {}


def harness_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each module of ``vlpe`` that imports project modules outside ``vlpe``, with those modules."""
    found = {}
    for name, deps in graph.items():
        if name.split(".")[0] == "vlpe":
            outside = sorted(d for d in deps if d.split(".")[0] != "vlpe")
            if outside:
                found[name] = outside
    return found


def test_harness_imports_are_found():
    """On a small graph: a library module importing a harness module is named, imports inside the library and
    the harness importing the library are not."""
    graph = {"vlpe.a": {"vlpe.b", "models.vit"}, "vlpe.b": set(), "models.vit": {"vlpe.a"}, "data.x": {"models.vit"}}
    assert harness_imports(graph) == {"vlpe.a": ["models.vit"]}


def test_the_library_imports_nothing_outside_vlpe():
    """``vlpe/`` imports no module of ``models/``, ``data/``, ``train/`` or ``eval/`` (anywhere in a module's body,
    as the graph counts), but the known exceptions listed above."""
    found = harness_imports(import_graph())
    assert found == KNOWN_HARNESS_IMPORTS, f"modules of vlpe importing the harness: {found}"
