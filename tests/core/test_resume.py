"""Crash anywhere, run again: the result is bit-identical to a run that never crashed.

The fake tree of test_engine.py with every stateful piece switched on (FedAdam both
ways, proxy TRAIN at the root, an up-residual from each edge to the root and a
down-residual from the root to each client, cohort sampling). A crash is an exception
raised at the k-th event (a TRAIN call, a finished node round, or a checkpoint write
between its temporary file and the rename), for every k; the same root execution is
then simply run again, as `bhfl resume` does.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.node_opt import NodeOptParams
from bhfl_core.algorithm.node_state import NodeState
from bhfl_core.algorithm.residuals import DownLink, UpLink
from bhfl_core.algorithm.tree import Tree
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import AddVectorHooks, settings, two_edge_tree

CLIENTS = ("a1", "a2", "b1", "b2")


class Crash(Exception):
    pass


def stateful_tree() -> Tree:
    adam = NodeOptParams("fedadam", eta=0.1, tau=0.01)
    tree = two_edge_tree(settings(train=True, eta_down=0.5), root_rounds=3)
    nodes = dict(tree.nodes)
    up = UpLink(rule=0, target="root", k=1, select="l2")
    for edge in ("A", "B"):
        nodes[edge] = replace(
            nodes[edge],
            settings=replace(nodes[edge].settings, rounds=2, cohort=1, opt_up=adam, opt_down=adam, res_up=(up,)),
        )
    nodes["root"] = replace(
        nodes["root"],
        settings=replace(
            nodes["root"].settings,
            opt_up=adam,
            res_in=(("up0", NodeOptParams("fedadam", eta=0.05, tau=0.01)),),
            res_down=tuple(DownLink(0, c) for c in CLIENTS),
        ),
    )
    for c in CLIENTS:
        nodes[c] = replace(
            nodes[c], settings=replace(nodes[c].settings, res_in=(("down0", NodeOptParams("fedavg", eta=0.3)),))
        )
    return Tree(nodes=nodes, root_id="root")


class CrashingHooks(AddVectorHooks):
    """Counts events and raises Crash at event number ``crash_at`` (None: never)."""

    def __init__(self, tree, store, crash_at):
        super().__init__(tree, store)
        self.crash_at, self.events = crash_at, 0

    def event(self):
        self.events += 1
        if self.events == self.crash_at:
            raise Crash(f"crash at event {self.events}")

    def train(self, node, theta, key, plan):
        self.event()
        return super().train(node, theta, key, plan)

    def round_done(self, node, key, theta, metrics):
        super().round_done(node, key, theta, metrics)
        self.event()


def run(folder: Path, crash_at=None) -> CrashingHooks:
    tree = stateful_tree()
    hooks = None

    def during_write(_tmp):
        if hooks is not None:
            hooks.event()

    store = StateStore(folder, before_replace=during_write)
    if not store.has("root"):
        store.save("root", NodeState(model=torch.zeros(2)))
    hooks = CrashingHooks(tree, store, crash_at)
    execute_node(tree, tree.root, None, store, hooks, seed=5)
    return hooks


def files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*.safetensors"))
        if "messages" not in p.parts
    }


@pytest.mark.integration
def test_crash_at_every_event_then_rerun_is_bit_identical(tmp_path):
    clean = run(tmp_path / "clean")
    want = files(tmp_path / "clean")
    assert {"nodes/root.safetensors", "nodes/a1.safetensors"} <= set(want)
    assert not any(k.startswith("residuals/root/") for k in want)  # the root consumed every up-residual
    assert any(k.startswith(("residuals/a", "residuals/b")) for k in want)  # unsampled clients: pending
    total = clean.events
    assert total > 60
    redone = []
    for k in range(1, total + 1):
        folder = tmp_path / f"crash-{k}"
        with pytest.raises(Crash):
            run(folder, crash_at=k)
        rerun = run(folder)
        got = files(folder)
        assert got == want, f"crash at event {k}: files differ: {sorted(n for n in want if got.get(n) != want[n])}"
        redone.append(rerun.events - (total - k))
    # a re-run repeats at most the interrupted client round (TRAIN, its checkpoint, round end)
    assert max(redone) <= 3 and sum(redone) < total, redone
