"""A server whose clients keep no state writes its round commit while its next round trains; it logs a round only
once it is durable, and ends its execution with everything durable (bhfl_core/algorithm/round_commits.py)."""

import threading

import pytest
import torch

from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.node_state import NodeState
from bhfl_core.algorithm.round_commits import commits_behind
from bhfl_core.algorithm.tree import Node, Role, Tree
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import AddVectorHooks, settings, two_edge_tree


def flat_tree(persistent: bool, rounds: int = 3) -> Tree:
    """root (FedAvg, ``rounds`` rounds) -> a1 (1 example), a2 (3): TRAIN adds [1, 0] and [0, 2]."""
    client = settings(persistent=persistent, train=True)
    nodes = {c: Node(c, Role.CLIENT, 1, "root", (), client, w) for c, w in (("a1", 1.0), ("a2", 3.0))}
    nodes["root"] = Node("root", Role.ROOT, 0, None, ("a1", "a2"), settings(rounds=rounds), 4.0)
    return Tree(nodes, "root")


class SlowStore(StateStore):
    """A store whose root commit of round r waits until round r + 1's children have trained (the last round's
    commit, with no next round, does not wait)."""

    def __init__(self, root, events):
        super().__init__(root)
        self.events, self.children_rounds, self.trained = events, 0, threading.Condition()

    def children_done(self) -> None:
        with self.trained:
            self.children_rounds += 1
            self.trained.notify_all()

    def commit(self, node_id, state, persist=True):
        if node_id == "root" and state.rounds_done < 3:  # not the last: its "next round" exists
            with self.trained:
                behind = self.trained.wait_for(lambda: self.children_rounds > state.rounds_done, timeout=10)
            assert behind, "the commit was not written behind the next round"
        super().commit(node_id, state, persist)
        self.events.append(("committed", node_id, state.rounds_done))


class Hooks(AddVectorHooks):
    def __init__(self, tree, store, events):
        super().__init__(tree, store)
        self.events = events

    def run_children(self, node, cohort, theta, plans):
        results = super().run_children(node, cohort, theta, plans)
        self.events.append(("children", node.id))
        self.store.children_done()
        return results

    def round_done(self, node, key, theta, metrics):
        super().round_done(node, key, theta, metrics)
        self.events.append(("logged", node.id, key.round + 1))


def test_commits_behind_only_where_no_child_keeps_state():
    assert commits_behind(flat_tree(persistent=False), flat_tree(persistent=False).root)
    assert not commits_behind(flat_tree(persistent=True), flat_tree(persistent=True).root)  # they read their models
    two_levels = two_edge_tree(settings(persistent=False, train=True))
    assert not commits_behind(two_levels, two_levels.root)  # child servers keep state: commits in order
    assert commits_behind(two_levels, two_levels["A"])
    assert not commits_behind(two_levels, two_levels["a1"])


def test_a_round_is_written_behind_the_next_one_logged_once_durable_and_the_result_is_unchanged(tmp_path):
    tree, events = flat_tree(persistent=False), []
    store = SlowStore(tmp_path / "behind", events)
    store.save("root", NodeState(model=torch.zeros(2)))
    execute_node(tree, tree.root, None, store, Hooks(tree, store, events), seed=0)
    root = [e for e in events if e[1] == "root"]
    assert root == [
        ("children", "root"),  # round 1's clients
        ("children", "root"),  # round 2's clients trained while round 1 was written ...
        ("committed", "root", 1),
        ("logged", "root", 1),  # ... and round 1 logged only once durable
        ("children", "root"),
        ("committed", "root", 2),
        ("logged", "root", 2),
        ("committed", "root", 3),  # the last round: durable and logged before the execution returns
        ("logged", "root", 3),
    ]
    plain = StateStore(tmp_path / "plain")
    plain.save("root", NodeState(model=torch.zeros(2)))
    execute_node(tree, tree.root, None, plain, AddVectorHooks(tree, plain), seed=0)
    # three rounds of the mean of [1, 0] (weight 1) and [0, 2] (weight 3): [0.25, 1.5] each
    assert store.load_model("root").tolist() == plain.load_model("root").tolist() == [0.75, 4.5]


def test_a_failed_commit_behind_fails_the_round_that_waits_for_it_and_logs_nothing(tmp_path):
    tree = flat_tree(persistent=False)

    class Failing(StateStore):
        def commit(self, node_id, state, persist=True):
            if node_id == "root":
                raise OSError(28, "No space left on device")
            super().commit(node_id, state, persist)

    store = Failing(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = AddVectorHooks(tree, store)
    with pytest.raises(OSError, match="No space left"):
        execute_node(tree, tree.root, None, store, hooks, seed=0)
    assert [r for r in hooks.rounds if r[0] == "root"] == [] and store.load("root").rounds_done == 0
