"""A tiny hand-built tree and in-process hooks whose TRAIN adds a known vector."""

from __future__ import annotations

import torch

from bhfl_core.algorithm.contract import ChildResult
from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.node_opt import NodeOptParams
from bhfl_core.algorithm.node_state import NodeResult
from bhfl_core.algorithm.residuals import Candidate
from bhfl_core.algorithm.tree import Node, NodeSettings, Role, TrainParams, Tree
from bhfl_core.store.node_store import StateStore


def settings(rounds=1, eta_down=1.0, eta_up=1.0, persistent=True, train=False, cohort=None, kind="fedavg"):
    return NodeSettings(
        rounds=rounds,
        cohort=cohort,
        persistent=persistent,
        train=TrainParams() if train else None,
        opt_up=NodeOptParams(kind=kind, eta=eta_up),
        opt_down=NodeOptParams(kind="fedavg", eta=eta_down),
    )


def two_edge_tree(client_settings: NodeSettings, root_rounds: int = 1, root_train: bool = True) -> Tree:
    """root -> edges A, B -> clients a1 (1 example), a2 (3), b1 (2), b2 (2)."""
    weights = {"a1": 1.0, "a2": 3.0, "b1": 2.0, "b2": 2.0}
    nodes = {
        cid: Node(cid, Role.CLIENT, 2, "A" if cid[0] == "a" else "B", (), client_settings, w)
        for cid, w in weights.items()
    }
    nodes["A"] = Node("A", Role.EDGE, 1, "root", ("a1", "a2"), settings(), 4.0)
    nodes["B"] = Node("B", Role.EDGE, 1, "root", ("b1", "b2"), settings(), 4.0)
    nodes["root"] = Node("root", Role.ROOT, 0, None, ("A", "B"), settings(rounds=root_rounds, train=root_train), 8.0)
    return Tree(nodes=nodes, root_id="root")


STEPS = {"a1": [1.0, 0.0], "a2": [0.0, 2.0], "b1": [2.0, 2.0], "b2": [4.0, 0.0], "root": [0.0, -1.0]}
TARGETS = {"a1": [1.0, 1.0], "a2": [0.0, 0.0], "b1": [3.0, 0.0], "b2": [0.0, 0.0], "A": [1.0, 1.0], "B": [0.0, 2.0]}


class AddVectorHooks:
    """Children run by plain recursion; TRAIN adds STEPS[node] to the model."""

    def __init__(self, tree: Tree, store: StateStore) -> None:
        self.tree, self.store = tree, store
        self.rounds: list[tuple[str, int]] = []
        self.metrics: dict[tuple[str, int], dict[str, float]] = {}

    def run_children(self, node, cohort, theta, plans) -> list[ChildResult]:
        results = []
        for child in cohort:
            out = execute_node(self.tree, child, theta, self.store, self, 0, plans[child.id])
            candidates = (Candidate(child.id, out.theta, child.weight, loss=float(out.theta.sum())),)
            results.append(
                ChildResult(
                    members=(child.id,),
                    model=out.theta,
                    weight=child.weight,
                    virtual_s=out.virtual_s,
                    candidates=candidates if node.settings.res_up else (),
                    sent_bytes=out.sent_bytes,
                )
            )
        return results

    def train(self, node, theta, key, plan):
        return NodeResult(theta + torch.tensor(STEPS[node.id]))

    def score(self, node, candidates):
        """Held-out loss: squared distance to TARGETS[node] (a known optimum)."""
        return [float(((c - torch.tensor(TARGETS[node.id])) ** 2).sum()) for c in candidates]

    def train_personal(self, node, personal, anchor, key):
        """Ditto stand-in: one step towards the anchor plus the node's STEPS (exact, checkable by hand)."""
        return NodeResult(personal + 0.5 * (anchor - personal) + torch.tensor(STEPS[node.id]), loss=0.0)

    def round_done(self, node, key, theta, metrics):
        self.rounds.append((node.id, key.round))
        self.metrics[(node.id, key.round)] = dict(metrics)
