"""One model's statistics as a worker scores them (``Scored``) and the metrics it sends back (``ModelValues``).

Workers return one block of additive statistics per (model, client test split or
proxy) (``bhfl_core.learning.metrics``); unions are sums of blocks, so scoring every
subtree costs nothing extra. ``MatrixBuilder`` reduces a model's blocks to its metrics
where they were scored: what travels is a few numbers per test set, whatever its size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bhfl_core.algorithm.tree import Tree
from bhfl_core.analysis.matrix_axes import PROXY, SUBTREE, UNION, ModelRef, all_test_sets, client_order, subtree_set
from bhfl_core.learning.task_kinds import TaskMetrics


@dataclass(frozen=True)
class Scored:
    """One model's statistics as a worker returns them: a block per client test split it was scored on, then
    one for the proxy test split.

    ``clients`` are positions in ``client_order(tree)`` (ascending), ``weights`` what each
    stands for in ``subtree:``/``union`` sums (None: itself; bhfl_core/analysis/eval_plan.py).
    ``blocks`` owns its storage (never a view of a larger tensor: pickled, a view takes its
    whole storage along), so what travels is ``len(clients) + 1`` blocks and no more.
    """

    ref: ModelRef
    clients: np.ndarray
    weights: np.ndarray | None
    blocks: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes + self.clients.nbytes + (0 if self.weights is None else self.weights.nbytes))


class UnionSets:
    """The ``subtree:<server>`` sets and ``union`` of a population (tree order), as a membership matrix.

    A model scored on the whole population sums its client blocks into every set with
    one matrix product, ``members [sets, clients] @ blocks`` (built once per evaluation).
    """

    def __init__(self, tree: Tree, population: Sequence[str]) -> None:
        index = {c: i for i, c in enumerate(population)}
        names = [n for n in all_test_sets(tree) if n.startswith(SUBTREE) or n == UNION]
        rows: list[tuple[str, list[int]]] = []
        for name in names:
            under = population if name == UNION else tree.leaves_under(name[len(SUBTREE) :])
            at = [index[c] for c in under if c in index]
            if at:
                rows.append((name, at))
        self.names = [name for name, _ in rows]
        self.members = torch.zeros(len(rows), len(population), dtype=torch.float64)
        for row, (_, at) in enumerate(rows):
            self.members[row, at] = 1.0


@dataclass(frozen=True)
class ModelValues:
    """One model's metrics, what a worker sends back for it: on each client test split it was scored on, and on
    its ``subtree:``, ``union`` and ``proxy`` sets. A few numbers per test set, whatever the test set's size."""

    ref: ModelRef
    clients: np.ndarray  # positions in client_order(tree), ascending
    on_clients: np.ndarray  # [clients, metrics] (float64)
    on_sets: dict[str, np.ndarray]  # subtree / union / proxy -> [metrics], in all_test_sets order

    @property
    def nbytes(self) -> int:
        return int(self.clients.nbytes + self.on_clients.nbytes + sum(v.nbytes for v in self.on_sets.values()))


class MatrixBuilder:
    """Turns a model's blocks into its ``ModelValues``: sums of client blocks for the union sets, then metrics.

    Built once per evaluation (the workers: once per run) for a population; the blocks are
    let go as soon as the metrics are computed, so nothing the size of a test table stays.
    A model scored on the whole population gets every ``subtree:`` set and ``union``, exact
    sums (one product with the membership matrix); one scored on part of it (eval_plan.py)
    gets, if a server, every set with a sampled client, if a client's model, its
    ancestors' subtrees and ``union``, weighted sums of what it was scored on.
    """

    def __init__(self, tree: Tree, task: TaskMetrics, population: Sequence[str] | None = None) -> None:
        self.tree, self.task = tree, task
        self.all_clients = client_order(tree)
        self.population = list(population) if population is not None else self.all_clients
        position = {c: i for i, c in enumerate(self.all_clients)}
        self._population = np.array([position[c] for c in self.population], dtype=np.int64)
        self._unions = UnionSets(tree, self.population)
        self._inside: dict[str, np.ndarray] = {}  # set -> which clients (client_order positions) it holds
        for name, row in zip(self._unions.names, self._unions.members):
            inside = np.zeros(len(self.all_clients), dtype=bool)
            inside[self._population[row.numpy() > 0]] = True
            self._inside[name] = inside

    def values(self, result: Scored) -> ModelValues:
        blocks = result.blocks.to(torch.float64)
        k = len(result.clients)
        client_blocks, proxy = blocks[:k], blocks[k:]
        flat = client_blocks.reshape(k, -1)
        if result.weights is None and np.array_equal(result.clients, self._population):
            names, members = self._unions.names, self._unions.members
            sums = (members @ flat).reshape(len(members), *client_blocks.shape[1:])
        else:  # small products: numpy's (torch's thread pool costs more than the product, ~1 ms a model)
            names, weighted = self._members(result)
            sums = torch.from_numpy(weighted @ flat.numpy()).reshape(len(weighted), *client_blocks.shape[1:])
        metrics = self.task.batch(torch.cat([client_blocks, sums, proxy]))
        table = np.stack([metrics[m].numpy() for m in self.task.names], axis=1)
        on_sets = {name: table[k + i] for i, name in enumerate([*names, PROXY])}
        return ModelValues(result.ref, np.asarray(result.clients, dtype=np.int64), table[:k], on_sets)

    def _members(self, result: Scored) -> tuple[list[str], np.ndarray]:
        node = self.tree[result.ref.node]
        if node.is_leaf:
            wanted = {subtree_set(a) for a in self.tree.ancestors(node.id) if a != self.tree.root_id} | {UNION}
        else:
            wanted = set(self._unions.names)
        weights = np.ones(len(result.clients)) if result.weights is None else np.asarray(result.weights, np.float64)
        names: list[str] = []
        rows: list[np.ndarray] = []
        for name in self._unions.names:
            if name in wanted and (inside := self._inside[name][result.clients]).any():
                names.append(name)
                rows.append(np.where(inside, weights, 0.0))
        return names, np.stack(rows) if rows else np.zeros((0, len(result.clients)))


Stats = Mapping[ModelRef, Mapping[str, torch.Tensor]]  # model -> client id / proxy -> statistics (hand-made tests)


def scored_from_stats(tree: Tree, stats: Stats) -> list[Scored]:
    """``Scored`` results from ``{model: {client id or 'proxy': block}}`` over every client (tests, tools)."""
    clients = client_order(tree)
    return [
        Scored(ref, np.arange(len(clients)), None, torch.stack([blocks[c] for c in [*clients, PROXY]]))
        for ref, blocks in stats.items()
    ]
