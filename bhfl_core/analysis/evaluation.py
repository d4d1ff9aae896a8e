"""The evaluation matrix: every model on every test set, and the per-client views of it.

Models are the tree's node models (servers and persistent clients, named by node id),
Ditto clients' personal models (``personal:<client>``) and, where run, two per-client
baselines: ``local:<client>`` (trained from the initial model on the client's own data
only) and ``adapt:<client>`` (a final model fine-tuned on the client's data: local
adaptation). Test sets are:

- ``<client id>``: that client's test split;
- ``subtree:<server>``: the union of the client test splits under a (non-root) server;
- ``union``: the union of all client test splits (the root's subtree);
- ``proxy``: the proxy test split.

Workers return one block of additive statistics per (model, client test split or
proxy) (``bhfl_core.learning.metrics``); unions are sums of blocks, so scoring every subtree
costs nothing extra. Rows are long-format ``(node, level, test_set, metric, value)``.

"Best / worst 10%" of a distribution over clients is the mean over the best / worst
``ceil(10% of n)`` clients (at least one), where best means highest for accuracy and
macro-F1 and lowest for loss and perplexity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from bhfl_core.algorithm.tree import Tree
from bhfl_core.analysis.distribution import STATS, ClientRow, Distribution, DistRow, distribution
from bhfl_core.analysis.matrix_axes import (
    PROXY,
    UNION,
    ModelRef,
    client_order,
    model_order,
)
from bhfl_core.analysis.model_values import MatrixBuilder, ModelValues, Stats, scored_from_stats
from bhfl_core.learning.task_kinds import TaskMetrics
from bhfl_core.store.tables import table_csv


@dataclass(frozen=True)
class EvalRow:
    node: str
    level: int
    test_set: str
    metric: str
    value: float


MATRIX_HEADER = ("node", "level", "test_set", "metric", "value")


def matrix_lines(rows: Iterable[EvalRow]) -> Iterator[list[object]]:
    """The cells of ``eval/matrix.csv``, row by row (``write_csv_atomic`` streams them to the file)."""
    return ([r.node, r.level, r.test_set, r.metric, f"{r.value:.6f}"] for r in rows)


def matrix_csv(rows: Iterable[EvalRow]) -> str:
    return table_csv(MATRIX_HEADER, matrix_lines(rows))


class Evaluation:
    """The evaluation matrix, as compact per-model arrays: lookups, the long-format rows, per-client views.

    Built one model at a time (``add``) from the ``ModelValues`` workers send back (their
    ``MatrixBuilder`` reduced the blocks): a few numbers per (model, test set) scored,
    never models x clients x examples. Everywhere outside a model is its ``name``;
    ``refs`` maps names to ``ModelRef``. ``clients`` is the population (every client, or
    the ``eval.clients`` sample), in tree order.
    """

    def __init__(
        self,
        tree: Tree,
        task: TaskMetrics,
        values: Iterable[ModelValues] = (),
        population: Sequence[str] | None = None,
    ) -> None:
        self.tree, self.task = tree, task
        every = client_order(tree)
        self.all_clients = every
        self._position = {c: i for i, c in enumerate(every)}
        self.clients = list(population) if population is not None else every
        self._population = np.array([self._position[c] for c in self.clients], dtype=np.int64)
        self._values: dict[str, ModelValues] = {}
        self.refs: dict[str, ModelRef] = {}
        self._models: list[str] | None = None
        for v in values:
            self.add(v)

    @classmethod
    def from_stats(cls, tree: Tree, task: TaskMetrics, stats: Stats) -> Evaluation:
        """From ``{model: {client id or 'proxy': block}}`` blocks over every client (tests, tools)."""
        builder = MatrixBuilder(tree, task)
        return cls(tree, task, [builder.values(s) for s in scored_from_stats(tree, stats)])

    def add(self, values: ModelValues) -> None:
        """One model's values (a worker's ``MatrixBuilder`` made them)."""
        self._values[values.ref.name] = values
        self.refs[values.ref.name] = values.ref
        self._models = None

    def with_values(self, value: Callable[[str, str], float | None]) -> Evaluation:
        """The same (model, test set) pairs with ``value(test set, metric)`` in place of each model's (sets it has no
        value for left out): e.g. a trivial baseline in every model's place, over the same clients."""
        mirror = Evaluation(self.tree, self.task, population=self.clients)
        metrics = self.task.names
        for v in self._values.values():
            clients = [self.all_clients[i] for i in v.clients]
            rows = [[value(c, m) for m in metrics] for c in clients]
            keep = [i for i, row in enumerate(rows) if None not in row]
            on_sets = {}
            for test_set in v.on_sets:
                row = [value(test_set, m) for m in metrics]
                if None not in row:
                    on_sets[test_set] = np.array(row, dtype=np.float64)
            table = np.array([rows[i] for i in keep], dtype=np.float64).reshape(len(keep), len(metrics))
            mirror.add(ModelValues(v.ref, v.clients[keep], table, on_sets))
        return mirror

    # ---------------------------------------------------------------- lookups

    @property
    def models(self) -> list[str]:
        """Model names in matrix order (``model_order``)."""
        if self._models is None:
            self._models = [r.name for r in model_order(self.tree, self.refs.values())]
        return self._models

    def _metric(self, metric: str | None) -> int:
        return self.task.names.index(metric or self.task.primary)

    def value(self, model: str, test_set: str, metric: str | None = None) -> float | None:
        v = self._values.get(model)
        if v is None:
            return None
        column = self._metric(metric)
        if test_set in v.on_sets:
            return float(v.on_sets[test_set][column])
        position = self._position.get(test_set)
        if position is None:
            return None
        at = int(np.searchsorted(v.clients, position))
        if at < len(v.clients) and v.clients[at] == position:
            return float(v.on_clients[at, column])
        return None

    def scored(self, model: str, metric: str | None = None) -> tuple[list[str], list[float]]:
        """The clients a model was scored on (tree order) and its metric on each."""
        v = self._values[model]
        return [self.all_clients[i] for i in v.clients], v.on_clients[:, self._metric(metric)].tolist()

    def node_models(self) -> list[str]:
        return [m for m in self.models if self.refs[m].kind == "node"]

    def population(self, model: str) -> list[str]:
        """The clients of a model's subtree in the population (a client's models: the client itself)."""
        start, end = self._span(self.refs[model].node)
        return self.clients[start:end]

    def subtree_size(self, model: str) -> int:
        """How many clients the model's subtree has in all (beyond the population, if it is a sample)."""
        return len(self.tree.leaves_under(self.refs[model].node))

    def _span(self, node_id: str) -> tuple[int, int]:
        leaves = self.tree.leaves_under(node_id)
        positions = self._population
        lo = int(np.searchsorted(positions, self._position[leaves[0]]))
        hi = int(np.searchsorted(positions, self._position[leaves[-1]], side="right"))
        return lo, hi

    def per_client(self, model: str, clients: Iterable[str], metric: str | None = None) -> list[float]:
        v = self._values.get(model)
        wanted = [self._position[c] for c in clients]
        if v is None or not wanted:
            return []
        at = np.searchsorted(v.clients, wanted)
        found = (at < len(v.clients)) & (v.clients[np.minimum(at, len(v.clients) - 1)] == wanted)
        return [float(x) for x in v.on_clients[at[found], self._metric(metric)]]

    def rows(self) -> Iterator[EvalRow]:
        """Long-format rows: models in matrix order, each on its client splits (tree order), then its
        ``subtree:`` sets, ``union`` and ``proxy``; metrics in the task's order."""
        for model in self.models:
            v = self._values[model]
            level = self.tree[self.refs[model].node].depth
            for i, position in enumerate(v.clients.tolist()):
                test_set = self.all_clients[position]
                for j, metric in enumerate(self.task.names):
                    yield EvalRow(model, level, test_set, metric, float(v.on_clients[i, j]))
            for test_set, values in v.on_sets.items():
                for j, metric in enumerate(self.task.names):
                    yield EvalRow(model, level, test_set, metric, float(values[j]))

    # ---------------------------------------------------------------- per-client views

    @property
    def sampled(self) -> bool:
        """Whether the population is a sample of the clients (``eval.clients: N``)."""
        return len(self.clients) < len(self.all_clients)

    def _distribution(self, model: str, clients: Sequence[str], total: int, metric: str) -> Distribution:
        """Over ``clients`` of the population; they stand for ``total`` clients when the model was scored on each of
        them and the population is a sample (then the mean has an interval), else for themselves."""
        if clients is self.clients:  # everything it was scored on (models are scored on population clients only)
            values = self._values[model].on_clients[:, self._metric(metric)].tolist()
        else:
            values = self.per_client(model, clients, metric)
        of = total if self.sampled and len(values) == len(clients) else len(values)
        return distribution(values, self.task.better(metric), of, self.task.bounds.get(metric))

    def _populations(self, model: str) -> tuple[tuple[str, list[str], int], ...]:
        return (
            ("subtree", self.population(model), self.subtree_size(model)),
            ("all", self.clients, len(self.all_clients)),
        )

    def distribution_rows(self) -> list[DistRow]:
        rows: list[DistRow] = []
        for model in self.models:
            level = self.tree[self.refs[model].node].depth
            for population, clients, of in self._populations(model):
                for metric in self.task.names:
                    rows.append(
                        DistRow(model, level, population, metric, self._distribution(model, clients, of, metric))
                    )
        return rows

    def node_metrics(self, model: str) -> dict[str, float]:
        """What a node's MLflow run gets per evaluation: its ``subtree:``, ``union`` and ``proxy`` values and its
        client distributions (each client's value is in ``eval/matrix.csv``: thousands of clients would be
        thousands of metrics a round on every server run)."""
        v = self._values[model]
        out = {
            f"eval/{t}/{m}": float(values[j]) for t, values in v.on_sets.items() for j, m in enumerate(self.task.names)
        }
        for population, clients, of in self._populations(model):
            for metric in self.task.names:
                d = self._distribution(model, clients, of, metric)
                out.update({f"dist/{population}/{metric}_{s}": getattr(d, s) for s in STATS})
                if d.of > d.n:
                    out.update({f"dist/{population}/{metric}_mean_low": d.mean_low})
                    out.update({f"dist/{population}/{metric}_mean_high": d.mean_high})
        return out

    def relatives(self, client: str) -> list[tuple[str, str]]:
        """``(relation, model)`` of the models that belong to a client, by relation to it.

        ``client`` (its own persistent model), ``personal`` (its Ditto personal model),
        ``edge`` (its parent server, whatever its level), ``server`` (intermediate
        ancestors; ``server-d<depth>`` if several), ``root``, and the baselines
        ``adapted`` and ``local_only``. Only models that were evaluated appear.
        """
        tree = self.tree
        chain = [("client", client), ("personal", ModelRef.personal(client).name)]
        ancestors = tree.ancestors(client)
        servers = [a for a in ancestors[1:] if a != tree.root_id]
        if ancestors:
            chain.append(("edge", ancestors[0]))
        chain += [("server" if len(servers) == 1 else f"server-d{tree[a].depth}", a) for a in servers]
        chain += [
            ("root", tree.root_id),
            ("adapted", ModelRef.adapted(client).name),
            ("local_only", ModelRef.local_only(client).name),
        ]
        return [(rel, m) for rel, m in chain if self.value(m, client) is not None]

    def gain(self, value: float, baseline: float, metric: str) -> float:
        """How much better ``value`` is than ``baseline`` (positive = better, for any metric direction)."""
        return value - baseline if self.task.better(metric) else baseline - value

    def client_rows(self) -> list[ClientRow]:
        """Each client's test split under each of its relatives' models, with the gain over local-only."""
        rows: list[ClientRow] = []
        for client in self.clients:
            for relation, model in self.relatives(client):
                for metric in self.task.names:
                    value = self.value(model, client, metric)
                    local = self.value(ModelRef.local_only(client).name, client, metric)
                    assert value is not None
                    gain = float("nan") if local is None else self.gain(value, local, metric)
                    rows.append(ClientRow(client, self.tree[client].group or "", relation, model, metric, value, gain))
        return rows

    def headline(self, metric: str | None = None) -> dict[str, float]:
        """Parent-run headlines: root on union/proxy; per relation, mean and worst 10% over clients.

        ``<relation>_on_own_clients/<metric>_mean`` averages, over clients, the metric of
        the client's relative (own model, parent server, ..., root, baselines) on the
        client's own test split. ``gain_vs_local/<relation>/<metric>_mean`` and
        ``..._share_better`` (share of clients with a positive gain) compare it with the
        client's local-only model, where that baseline ran.
        """
        metric = metric or self.task.primary
        better = self.task.better(metric)
        out: dict[str, float] = {}
        root = self.tree.root_id
        for test_set in (UNION, PROXY):
            v = self.value(root, test_set, metric)
            if v is not None:
                out[f"root/{test_set}/{metric}"] = v
        per_relation: dict[str, list[float]] = {}
        gains: dict[str, list[float]] = {}
        for client in self.clients:
            local = self.value(ModelRef.local_only(client).name, client, metric)
            for relation, model in self.relatives(client):
                value = self.value(model, client, metric)
                assert value is not None
                per_relation.setdefault(relation, []).append(value)
                if local is not None and relation != "local_only":
                    gains.setdefault(relation, []).append(self.gain(value, local, metric))
        for relation, values in per_relation.items():
            of = round(len(values) * len(self.all_clients) / len(self.clients))  # the clients they stand for
            d = distribution(values, better, of, self.task.bounds.get(metric))
            out[f"{relation}_on_own_clients/{metric}_mean"] = d.mean
            out[f"{relation}_on_own_clients/{metric}_worst10"] = d.worst10
            if d.of > d.n:  # a sample of the clients: the interval of the mean over all of them
                out[f"{relation}_on_own_clients/{metric}_mean_low"] = d.mean_low
                out[f"{relation}_on_own_clients/{metric}_mean_high"] = d.mean_high
        for relation, values in gains.items():
            out[f"gain_vs_local/{relation}/{metric}_mean"] = sum(values) / len(values)
            out[f"gain_vs_local/{relation}/{metric}_share_better"] = sum(g > 0 for g in values) / len(values)
        return out
