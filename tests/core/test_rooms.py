"""The rooms of the code import one way: down (docs/design.md, "The rooms").

Every module of bhfl_core, data_prep, tasks and flows is parsed (not imported) and every
import it holds is checked: module-level, inside functions (this codebase imports
torch, transformers, matplotlib and its own heavy modules where they are used) and
under ``TYPE_CHECKING`` (a type is a dependency too). A module belongs to the room of
the longest prefix in ``ROOMS`` that names it; it may import its own room and the rooms
listed before it, never one after. A new folder without a room falls into its parent's
room, so it is checked from its first import.

Beside the order, a few rooms must never import some libraries: bhfl_core is a plain
library (no prefect, no mlflow: docs/design.md), data_prep writes artefacts on its own,
and only flows talks to MLflow. The import-time guard in test_pieces.py stays: it
catches what an import drags in indirectly; this one catches imports in function
bodies, which importing a module never executes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from tests.source_imports import Import, all_modules, imports

PACKAGES = ("bhfl_core", "data_prep", "tasks", "flows")

ROOMS = (  # bottom first
    "bhfl_core",  # the package itself: a new top-level module lands here until it is given a room
    "bhfl_core.rng",  # seeded draws keyed by where they happen
    "bhfl_core.config.base",  # what every config section shares: Strict, ConfigError
    "bhfl_core.placement",  # clients on worker slots
    "bhfl_core.algorithm",  # the paper; declares the store it needs (store_protocol.py)
    "bhfl_core.learning",  # TRAIN and EVAL, the model section of a config (model_config.py)
    "bhfl_core.store",  # persistence of the algorithm's states
    "bhfl_core.analysis",  # after training: evaluation, proximity, communication, seeds, comparison tables
    "bhfl_core.config",  # YAML to typed values, checked against every registry below
    "data_prep",
    "tasks",
    "flows.services",  # the Prefect server a run owns, SQLite store templates
    "flows.progress",  # progress lines on the terminal (tracking reports delivery through them)
    "flows.records",
    "flows.tracking",
    "flows",  # the flows themselves
    "flows.cli",
)

UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {
    # (importing module, imported module): why it is allowed for now. Empty: none today.
}

FORBIDDEN = {  # room prefix -> top-level packages its modules must not import
    "bhfl_core": ("prefect", "mlflow"),
    "data_prep": ("prefect", "mlflow"),
    "tasks": ("mlflow",),
}


def room(module: str, rooms: Sequence[str] = ROOMS) -> int | None:
    """The index in ``rooms`` of the longest prefix naming ``module`` (None: outside the four packages)."""
    matches = [i for i, r in enumerate(rooms) if module == r or module.startswith(f"{r}.")]
    return max(matches, key=lambda i: len(rooms[i])) if matches else None


def upward(found: Iterable[Import], rooms: Sequence[str] = ROOMS) -> list[str]:
    """Each import of a room listed after the importer's own, as ``module:line -> target (room -> room)``."""
    bad = []
    for imp in found:
        here, there = room(imp.module, rooms), room(imp.target, rooms)
        if here is None or there is None or there <= here:
            continue
        if (imp.module, imp.target) not in UPWARD_EXCEPTIONS:
            bad.append(f"{imp.module}:{imp.line} -> {imp.target} ({rooms[here]} -> {rooms[there]})")
    return bad


def forbidden(found: Iterable[Import], rules: Mapping[str, Sequence[str]] = FORBIDDEN) -> list[str]:
    bad = []
    for imp in found:
        for prefix, libraries in rules.items():
            library = imp.target.split(".")[0]
            if (imp.module == prefix or imp.module.startswith(f"{prefix}.")) and library in libraries:
                bad.append(f"{imp.module}:{imp.line} imports {imp.target}")
    return bad


def _every_import() -> list[Import]:
    modules = all_modules(PACKAGES)
    return [imp for module, source in modules.items() for imp in imports(module, source, modules)]


def test_no_room_imports_a_room_above_it():
    found = _every_import()
    # the walk sees all four packages, inside functions too (flows/evaluation.py imports the report there)
    assert {room(imp.module) for imp in found} >= {ROOMS.index(r) for r in ("bhfl_core.algorithm", "flows.cli")}
    assert any(i.module == "flows.evaluation" and i.target == "flows.tracking.report" for i in found)
    assert [f"{i.module}:{i.line}" for i in found if i.target.startswith(".")] == []  # absolute imports only
    assert upward(found) == []


def test_exceptions_are_still_needed():
    """An exception nobody needs any more is removed, so the list only ever shrinks."""
    found = {(imp.module, imp.target) for imp in _every_import()}
    assert [pair for pair in UPWARD_EXCEPTIONS if pair not in found] == []


def test_core_and_data_prep_never_import_prefect_or_mlflow_and_tasks_never_mlflow():
    assert forbidden(_every_import()) == []


def test_the_check_sees_imports_in_functions_and_submodules_named_by_from():
    known = {"flows", "flows.progress", "flows.cli", "flows.cli.compare"}
    source = (
        "from flows import progress\n"
        "def f():\n"
        "    from flows.cli import compare\n"
        "    import mlflow.tracking\n"
        "if TYPE_CHECKING:\n"
        "    from flows.cli.compare import HEADERS\n"
    )
    found = imports("flows.tracking.x", source, known)
    assert [(i.line, i.target) for i in found] == [
        (1, "flows.progress"),
        (3, "flows.cli.compare"),
        (4, "mlflow.tracking"),
        (6, "flows.cli.compare"),
    ]
    assert upward(found) == [
        "flows.tracking.x:3 -> flows.cli.compare (flows.tracking -> flows.cli)",
        "flows.tracking.x:6 -> flows.cli.compare (flows.tracking -> flows.cli)",
    ]
    assert forbidden([Import("bhfl_core.algorithm.y", 9, "mlflow.tracking")]) == [
        "bhfl_core.algorithm.y:9 imports mlflow.tracking"
    ]
    assert room("bhfl_core.config.base") == ROOMS.index("bhfl_core.config.base")
    assert room("bhfl_core.config.schema") == ROOMS.index("bhfl_core.config")
    assert room("numpy") is None
