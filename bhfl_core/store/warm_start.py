"""Warm starts (``model.init_from: RUN[:NODE]``): which saved models of a finished run a new run starts from.

Two shapes, both *model only* (a warm-started node gets fresh optimiser states, round
counter 0 and no consumed-residual marks, exactly like a node that was just given an
initial model):

- ``RUN:NODE``: the new run's root starts from NODE's model; every other node starts
  without a model and adopts its parent's on its first execution, as in any run.
- ``RUN``: tree-shaped: every node of the new tree whose namesake saved a model in RUN
  starts from it (servers and persistent clients alike); the others start empty.

This module is the pure part: parsing the value, planning the copy, the config keys
that must agree between the two runs, and the copy between two state stores. Finding
and checking RUN (its folder, record, status) is the flows' job
(flows/records/warm_source.py): run folders and ``run.json`` belong there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bhfl_core.algorithm.node_state import NodeState
from bhfl_core.config.base import ConfigError

if TYPE_CHECKING:
    from bhfl_core.store.node_store import StateStore

KEY = "model.init_from"
AGREEING_SECTIONS = ("model", "data.task")
"""What the source run's config must share with the new one (``model.init_from`` itself aside):
the model's architecture and task decide the shape and meaning of every saved vector."""


@dataclass(frozen=True)
class InitFrom:
    """A parsed ``model.init_from``: the run (as written) and the node (None: tree-shaped)."""

    run: str
    node: str | None = None

    def __str__(self) -> str:
        return self.run if self.node is None else f"{self.run}:{self.node}"


def parse_init_from(value: str) -> InitFrom:
    """``RUN[:NODE]``: the node is what follows the last ``:``, when it holds no ``/``.

    So ``runs/a/20260101-000000-000:edge-de`` names a node and ``/mnt/x:y/run`` does not.
    """
    if not value.strip():
        raise ConfigError(f"{KEY}: an empty value; give a run folder, optionally with :NODE (e.g. runs/x/STAMP:root)")
    head, sep, tail = value.rpartition(":")
    if not sep or "/" in tail:
        return InitFrom(value)
    if not head or not tail:
        raise ConfigError(
            f"{KEY}: {value!r}: expected RUN or RUN:NODE (e.g. runs/x/STAMP:root); a side of ':' is empty"
        )
    return InitFrom(head, tail)


def copy_plan(spec: InitFrom, target_nodes: Iterable[str], target_root: str) -> dict[str, str]:
    """Target node -> the source node whose model it starts from (the root last: see ``copy_models``).

    ``RUN:NODE`` plans the root alone; ``RUN`` plans every target node from its
    namesake (those the source never saved are skipped when copying).
    """
    if spec.node is not None:
        return {target_root: spec.node}
    others = [n for n in target_nodes if n != target_root]
    return {**{n: n for n in others}, target_root: target_root}


def copy_models(source: StateStore, target: StateStore, plan: Mapping[str, str]) -> list[str]:
    """Write each planned source model as the whole state of its target node; return the nodes written.

    Nodes the source holds no model of are skipped, except the root (the plan's last
    entry), which must exist. The root is written last, so "the target store has a
    root" means "the copy is complete": a run killed while copying copies again when
    resumed, and a resumed run whose store has its root never copies a second time.
    """
    written = []
    items = list(plan.items())
    for i, (target_node, source_node) in enumerate(items):
        model = source.load_model(source_node)
        if model is None:
            if i == len(items) - 1:
                raise ConfigError(f"{KEY}: the source run has no saved model of node {source_node!r}")
            continue
        target.save(target_node, NodeState(model=model))
        written.append(target_node)
    return written


def config_mismatch(source: Mapping[str, Any], target: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """The first key of ``AGREEING_SECTIONS`` whose value differs between two dumped configs, else None.

    Returns ``(dotted key, source value, target value)``; ``model.init_from`` is ignored.
    """
    for section in AGREEING_SECTIONS:
        found = _first_difference(_at(source, section), _at(target, section), section)
        if found is not None:
            return found
    return None


def _at(data: Mapping[str, Any], dotted: str) -> Any:
    value: Any = data
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _first_difference(a: Any, b: Any, key: str) -> tuple[str, Any, Any] | None:
    if key == KEY:
        return None
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for name in sorted(set(a) | set(b), key=str):
            found = _first_difference(a.get(name), b.get(name), f"{key}.{name}")
            if found is not None:
                return found
        return None
    return None if a == b else (key, a, b)
