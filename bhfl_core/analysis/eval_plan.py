"""Which client test splits each model is scored on: evaluation linear in the population, not quadratic.

Scoring every model on every client's test split costs models x clients passes, and
with a model per client that is clients²: 10,000 persistent clients would be 10^8
scores. Two settings of ``eval`` bound it (docs/evaluation.md, "At scale"):

- ``clients: all | N`` — the *population* of an evaluation: every client (the default),
  or a sample of N of them drawn once per run (``(seed, "eval-clients")``, the same
  clients at every evaluation). Models are scored on the population's test splits only;
  distributions over clients, the headlines over clients and the ``subtree:``/``union``
  values are then over the sample (the report gives the sample size and 95% intervals).
- ``client_model_sample: all | K`` (default 20) — a model that belongs to one client
  (its persistent model, its Ditto personal model, its local-only and adapted
  baselines) is scored on the client's own split and on up to K clients of each *ring*
  around it: the other clients under its edge server, then those under each further
  ancestor and not under the one before (tree distance 2, 4, ...). Each ring's sample
  is drawn from ``(seed, "eval-ring", client, ring)``: the same at every evaluation.
  Its values on its ancestors' subtrees and on ``union`` weigh each sampled client by
  ``ring size / sampled`` (a ratio estimate of the whole ring). Where every ring has at
  most K clients (the embedded default's have at most 18) the sample is every client:
  exactly what scoring on everything gives. Cost: 1 + K x depth splits per client model.

Servers are scored on the whole population. The plan is a pure function of the tree,
the seed and these settings, so the orchestrator and every worker compute the same one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bhfl_core.algorithm.tree import Tree
from bhfl_core.analysis.matrix_axes import client_order, dfs_order
from bhfl_core.rng import generator


@dataclass(frozen=True)
class Targets:
    """The client test splits one model is scored on.

    ``clients``: positions in ``client_order(tree)``, ascending (tree order); ``weights``:
    the number of population clients each one stands for in ``subtree:``/``union`` sums,
    None where each stands for itself (a complete population, or a server on a sample).
    """

    clients: np.ndarray
    weights: np.ndarray | None


class EvalPlan:
    """The population of an evaluation and each model's targets (module docstring)."""

    def __init__(self, tree: Tree, seed: int, clients: int | None, per_ring: int | None) -> None:
        self.tree, self.seed, self.per_ring = tree, seed, per_ring
        every = client_order(tree)
        self.position = {c: i for i, c in enumerate(every)}
        if clients is None or clients >= len(every):
            chosen = np.arange(len(every))
        else:
            chosen = np.sort(generator(seed, "eval-clients").choice(len(every), size=clients, replace=False))
        self.population: list[str] = [every[i] for i in chosen]
        self.complete = len(self.population) == len(every)
        self._members = chosen.astype(np.int64)  # population -> position in client_order
        self._index = {c: i for i, c in enumerate(self.population)}
        self._span = self._spans(tree)

    def _spans(self, tree: Tree) -> dict[str, tuple[int, int]]:
        """Each node's population clients as a range of population indices (tree order keeps a subtree's
        leaves together)."""
        spans: dict[str, tuple[int, int]] = {}
        for node_id in reversed(dfs_order(tree)):  # children before parents
            node = tree[node_id]
            if node.is_leaf:
                at = self._index.get(node_id)
                spans[node_id] = (at, at + 1) if at is not None else (-1, -1)
                continue
            inner = [spans[c] for c in node.children if spans[c][0] >= 0]
            spans[node_id] = (min(s for s, _ in inner), max(e for _, e in inner)) if inner else (-1, -1)
        return spans

    def span(self, node_id: str) -> tuple[int, int]:
        """Population indices ``[start, end)`` of the clients under ``node_id`` (``(-1, -1)``: none)."""
        return self._span[node_id]

    def server_targets(self) -> Targets:
        return Targets(self._members, None)

    def client_targets(self, client: str) -> Targets | None:
        """The targets of a model of ``client``; None when the client is not in the population."""
        at = self._index.get(client)
        if at is None:
            return None
        picked: list[np.ndarray] = [np.array([at])]
        weights: list[np.ndarray] = [np.ones(1)]
        sampled = False
        low, high = at, at + 1
        for ring, ancestor in enumerate(self.tree.ancestors(client), start=1):
            start, end = self._span[ancestor]
            members = np.concatenate([np.arange(start, low), np.arange(high, end)])
            low, high = start, end
            if not len(members):
                continue
            if self.per_ring is not None and len(members) > self.per_ring:
                draw = generator(self.seed, "eval-ring", client, ring).choice(len(members), self.per_ring, False)
                weight = len(members) / self.per_ring
                members, sampled = members[np.sort(draw)], True
            else:
                weight = 1.0
            picked.append(members)
            weights.append(np.full(len(members), weight))
        if not sampled:
            return self.server_targets()
        index = np.concatenate(picked)
        order = np.argsort(index, kind="stable")
        return Targets(self._members[index[order]], np.concatenate(weights)[order])
