"""Asynchronous nodes, crashed anywhere and run again: bit-identical to a run that never crashed.

The crash-at-every-event test of test_resume.py for trees with asynchronous nodes:
persistent clients that mix their own model into what they receive (so a client whose
state ran ahead of its parent's checkpoint would change the result), FedAdam at the
asynchronous nodes, proxy TRAIN at the root, children finishing out of dispatch order
on the virtual clock. Children run by plain recursion, at once when dispatched or only
when awaited (both are orders a real run can take).
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.async_engine import execute_async_node
from bhfl_core.algorithm.asynchrony import AsyncParams
from bhfl_core.algorithm.contract import ROOT_PLAN, ChildResult
from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.node_opt import NodeOptParams
from bhfl_core.algorithm.node_state import NodeResult, NodeState
from bhfl_core.algorithm.round_tail import VIRTUAL_TIME
from bhfl_core.algorithm.tree import Node, Role, Tree
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import STEPS, settings
from tests.core.test_resume import Crash, CrashingHooks

ADAM = NodeOptParams("fedadam", eta=0.1, tau=0.01)
STEPS = {**STEPS, "a3": [1.0, 1.0]}  # what TRAIN adds at each node with data


def mixed_tree(root_async: bool) -> Tree:
    """root -> A (async, 3 clients), B (async or sync, 2 clients); the root sync or async, with proxy TRAIN
    alongside its children (``proxy_train: async``).

    Clients are persistent with eta_down 0.5: each call starts from the mean of its own
    model and the one it was sent.
    """
    client = settings(train=True, eta_down=0.5)
    weights = {"a1": 1.0, "a2": 3.0, "a3": 2.0, "b1": 2.0, "b2": 2.0}
    nodes = {c: Node(c, Role.CLIENT, 2, "A" if c[0] == "a" else "B", (), client, w) for c, w in weights.items()}
    edge_a = replace(settings(rounds=2, kind="fedadam"), opt_up=ADAM, asynchronous=AsyncParams(2, 2))
    edge_b = replace(settings(rounds=2), asynchronous=None if root_async else AsyncParams(1, 1))
    nodes["A"] = Node("A", Role.EDGE, 1, "root", ("a1", "a2", "a3"), edge_a, 6.0)
    nodes["B"] = Node("B", Role.EDGE, 1, "root", ("b1", "b2"), edge_b, 4.0)
    root = replace(settings(rounds=3 if root_async else 2, train=True), opt_up=ADAM, proxy_async=True)
    if root_async:  # children are servers: their durations are known only when they return
        root = replace(root, asynchronous=AsyncParams(2, 1))
    nodes["root"] = Node("root", Role.ROOT, 0, None, ("A", "B"), root, 10.0)
    return Tree(nodes=nodes, root_id="root")


def client_seconds(child: str, dispatch: int) -> float:
    """Durations that reorder arrivals: later dispatches often overtake earlier ones."""
    return 1.0 + (7 * len(child) + 3 * int(child[1]) + 5 * dispatch) % 4


class AsyncHooks(CrashingHooks):
    """Sync and async nodes by plain recursion; a dispatched child runs at once (eager) or when awaited."""

    def __init__(self, tree, store, crash_at, eager):
        super().__init__(tree, store, crash_at)
        self.eager = eager
        self.callers: list[tuple[str, str]] = []

    def execute(self, child, theta, plan):
        run = execute_async_node if child.settings.asynchronous is not None else execute_node
        return run(self.tree, child, theta, self.store, self, 5, plan)

    def child_result(self, child, theta, plan):
        out = self.execute(child, theta, plan)
        return ChildResult(members=(child.id,), model=out.theta, weight=child.weight, virtual_s=out.virtual_s)

    def start_child(self, node, child, theta, plan):
        self.event()
        self.callers.append((child.id, plan.caller.key))
        call = Call(lambda: self.child_result(child, theta, plan))
        if self.eager:
            call.result()
        return call

    def train(self, node, theta, key, plan):
        self.event()
        return NodeResult(theta + torch.tensor(STEPS[node.id]), steps=2 if not node.is_leaf else 0)

    def start_train(self, node, theta, key):
        self.event()
        call = Call(lambda: NodeResult(theta + torch.tensor(STEPS[node.id]), examples=3, steps=2))
        if self.eager:
            call.result()
        return call

    def call_duration(self, node, child, plan):
        return client_seconds(child.id, plan.caller.round) if child.is_leaf else None

    def run_children(self, node, cohort, theta, plans):
        results = []
        for child in cohort:
            result = self.child_result(child, theta, plans[child.id])
            results.append(replace(result, virtual_s=result.virtual_s if not child.is_leaf else 1.0))
        return results


class Call:
    """A child execution that runs the first time its result is asked for."""

    def __init__(self, execute):
        self.execute, self.done = execute, None

    def result(self):
        if self.done is None:
            self.done = self.execute()
        return self.done


def run(folder: Path, root_async: bool, eager: bool, crash_at=None) -> AsyncHooks:
    tree = mixed_tree(root_async)
    hooks = None

    def during_write(_tmp):
        if hooks is not None:
            hooks.event()

    store = StateStore(folder, before_replace=during_write)
    if not store.has("root"):
        store.save("root", NodeState(model=torch.zeros(2)))
    hooks = AsyncHooks(tree, store, crash_at, eager)
    hooks.execute(tree.root, None, ROOT_PLAN)
    return hooks


def files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*.safetensors"))
        if "messages" not in p.parts
    }


@pytest.mark.parametrize("eager", [True, False], ids=["eager-children", "lazy-children"])
@pytest.mark.parametrize("root_async", [False, True], ids=["async-edges-sync-root", "async-root-over-servers"])
def test_crash_at_every_event_then_rerun_is_bit_identical(tmp_path, root_async, eager):
    clean = run(tmp_path / "clean", root_async, eager)
    want = files(tmp_path / "clean")
    assert not any(k.startswith("results/") for k in want)  # every saved child result was cleared by a commit
    root = StateStore(tmp_path / "clean").load("root")
    assert root.rounds_done == (3 if root_async else 2) and root.metrics[VIRTUAL_TIME] > 0
    assert root.metrics["Training/proxy_examples"] == 3.0  # the root's proxy TRAIN was merged in its last round
    # dispatch numbers count on across an async node's executions: no caller is ever used twice
    assert len(set(clean.callers)) == len(clean.callers)
    total = clean.events
    assert total > 60
    for k in range(1, total + 1):
        folder = tmp_path / f"crash-{k}"
        with pytest.raises(Crash):
            run(folder, root_async, eager, crash_at=k)
        run(folder, root_async, eager)
        got = files(folder)
        assert got == want, f"crash at event {k}: files differ: {sorted(n for n in want if got.get(n) != want[n])}"
