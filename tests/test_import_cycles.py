"""No import cycles among the project's own modules (bhfl_core, data_prep, tasks, flows, benchmarks).

Two modules that import each other have no order: neither can be read, tested or
replaced without the other, and which one loads first decides what the other sees half
initialised. A cycle is opened by moving what both sides need to a module below them
(a protocol, a type, a shared helper), not by hiding one of the imports.

Every import counts, wherever it sits (tests/source_imports.py): at module level, under
``if TYPE_CHECKING:`` (a type is a dependency too) and **inside functions**. A
function-level import that closes a cycle only moves the cycle from import time to call
time, so it is a cycle all the same; the function-level imports that are legitimately
lazy (torch, transformers, matplotlib, mlflow: heavy libraries loaded where they are
used) name modules outside the project and never form one. An import of ``a.b.c`` is
an edge to ``a.b.c`` (the package ``__init__`` modules above it import nothing of the
project; if one did, its own imports would be edges too). benchmarks/ holds scripts
that import their siblings by bare name (``from _proc import TreeSampler``, the script's
folder being first on ``sys.path``): such a name is the sibling module.

The test names every cycle with the imports that close it (``module:line -> module``).
"""

from __future__ import annotations

from collections.abc import Mapping

from tests.source_imports import Import, all_modules, imports

PACKAGES = ("bhfl_core", "data_prep", "tasks", "flows", "benchmarks")
SCRIPTS = "benchmarks"  # a folder of scripts: a bare import name may be a sibling


def resolve(imp: Import, modules: Mapping[str, str]) -> str | None:
    """The project module ``imp`` loads, or None when it names something outside the project."""
    if imp.module.startswith(f"{SCRIPTS}.") and f"{SCRIPTS}.{imp.target}" in modules:
        return f"{SCRIPTS}.{imp.target}"
    return imp.target if imp.target in modules else None


def import_graph(modules: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first import of it}."""
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, source in modules.items():
        for imp in imports(module, source, modules):
            target = resolve(imp, modules)
            if target is not None and target != module:
                graph[module].setdefault(target, imp.line)
    return graph


def cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def described(component: list[str], graph: Mapping[str, Mapping[str, int]]) -> str:
    inside = set(component)
    edges = [f"{m}:{line} -> {t}" for m in component for t, line in sorted(graph[m].items()) if t in inside]
    return "cycle of " + ", ".join(component) + ":\n    " + "\n    ".join(edges)


def test_no_module_imports_itself_through_others():
    modules = all_modules(PACKAGES)
    graph = import_graph(modules)
    # the walk sees all five folders, and benchmarks' bare sibling imports
    assert {m.split(".")[0] for m in graph if graph[m]} == set(PACKAGES)
    assert "benchmarks._proc" in graph["benchmarks._scale_measure"]
    assert [described(c, graph) for c in cycles(graph)] == []


def test_the_check_counts_imports_in_functions_and_under_type_checking():
    modules = {
        "pkg.a": "from pkg import b\n",
        "pkg.b": "def f():\n    from pkg.c import thing\n",  # function level: counted
        "pkg.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\nimport torch\n",
        "pkg.d": "import pkg.a\n",  # imports into the cycle, is not in it
        "benchmarks.run": "from _helper import x\n",
        "benchmarks._helper": "import benchmarks.run\n",
    }
    graph = import_graph(modules)
    assert graph["pkg.c"] == {"pkg.a": 3}  # torch is outside the project
    assert cycles(graph) == [["benchmarks._helper", "benchmarks.run"], ["pkg.a", "pkg.b", "pkg.c"]]
    assert described(["pkg.a", "pkg.b", "pkg.c"], graph) == (
        "cycle of pkg.a, pkg.b, pkg.c:\n    pkg.a:1 -> pkg.b\n    pkg.b:2 -> pkg.c\n    pkg.c:3 -> pkg.a"
    )
