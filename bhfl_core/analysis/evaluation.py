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

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from bhfl_core.algorithm.tree import Tree
from bhfl_core.learning.task_kinds import TaskMetrics
from bhfl_core.store.tables import table_csv

UNION = "union"
PROXY = "proxy"
SUBTREE = "subtree:"

ModelKind = Literal["node", "personal", "local_only", "adapted"]
_PREFIX: dict[ModelKind, str] = {"node": "", "personal": "personal:", "local_only": "local:", "adapted": "adapt:"}


def subtree_set(node_id: str) -> str:
    return f"{SUBTREE}{node_id}"


@dataclass(frozen=True)
class ModelRef:
    """A model in the matrix: the tree node it belongs to and its kind.

    ``kind`` is ``node`` (a node's own model), ``personal`` (a Ditto client's personal
    model), ``local_only`` or ``adapted`` (the per-client baselines of client ``node``).
    ``name`` is how the model is written in the matrix, MLflow metrics and reports: the
    node id, ``personal:<client>``, ``local:<client>`` or ``adapt:<client>``.
    """

    node: str
    kind: ModelKind

    def __post_init__(self) -> None:
        if self.kind not in _PREFIX:
            raise ValueError(f"unknown model kind {self.kind!r}")

    @classmethod
    def of_node(cls, node_id: str) -> ModelRef:
        return cls(node_id, "node")

    @classmethod
    def personal(cls, client_id: str) -> ModelRef:
        return cls(client_id, "personal")

    @classmethod
    def local_only(cls, client_id: str) -> ModelRef:
        return cls(client_id, "local_only")

    @classmethod
    def adapted(cls, client_id: str) -> ModelRef:
        return cls(client_id, "adapted")

    @property
    def name(self) -> str:
        return f"{_PREFIX[self.kind]}{self.node}"


def dfs_order(tree: Tree) -> list[str]:
    """Node ids in depth-first pre-order (root, first subtree, ...): clients of a server stay together."""
    out: list[str] = []
    stack = [tree.root_id]
    while stack:
        node_id = stack.pop()
        out.append(node_id)
        stack.extend(reversed(tree[node_id].children))
    return out


def client_order(tree: Tree) -> list[str]:
    return [n for n in dfs_order(tree) if tree[n].is_leaf]


def all_test_sets(tree: Tree) -> list[str]:
    """Client tests (tree order), ``subtree:<server>`` for each non-root server, ``union``, ``proxy``."""
    subtrees = [subtree_set(n) for n in dfs_order(tree) if not tree[n].is_leaf and n != tree.root_id]
    return [*client_order(tree), *subtrees, UNION, PROXY]


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


@dataclass(frozen=True)
class EvalRow:
    node: str
    level: int
    test_set: str
    metric: str
    value: float


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

_KIND_RANK: dict[ModelKind, int] = {"node": 0, "personal": 1, "adapted": 2, "local_only": 3}


def model_order(tree: Tree, models: Iterable[ModelRef]) -> list[ModelRef]:
    """Node models in tree order, then personal models, adapted baselines, local-only ones (each in tree order)."""
    position = {n: i for i, n in enumerate(dfs_order(tree))}
    return sorted(models, key=lambda m: (_KIND_RANK[m.kind], position[m.node]))


def scored_from_stats(tree: Tree, stats: Stats) -> list[Scored]:
    """``Scored`` results from ``{model: {client id or 'proxy': block}}`` over every client (tests, tools)."""
    clients = client_order(tree)
    return [
        Scored(ref, np.arange(len(clients)), None, torch.stack([blocks[c] for c in [*clients, PROXY]]))
        for ref, blocks in stats.items()
    ]


MATRIX_HEADER = ("node", "level", "test_set", "metric", "value")


def matrix_lines(rows: Iterable[EvalRow]) -> Iterator[list[object]]:
    """The cells of ``eval/matrix.csv``, row by row (``write_csv_atomic`` streams them to the file)."""
    return ([r.node, r.level, r.test_set, r.metric, f"{r.value:.6f}"] for r in rows)


def matrix_csv(rows: Iterable[EvalRow]) -> str:
    return table_csv(MATRIX_HEADER, matrix_lines(rows))


# ---------------------------------------------------------------- distributions over clients


def _tail_mean(values: Sequence[float], fraction: float, highest: bool) -> float:
    clean = sorted((v for v in values if not math.isnan(v)), reverse=highest)
    if not clean:
        return float("nan")
    k = max(1, math.ceil(fraction * len(clean)))
    return sum(clean[:k]) / k


def worst_fraction_mean(values: Sequence[float], fraction: float = 0.1, higher_is_better: bool = True) -> float:
    """Mean of the worst ``fraction`` of values (at least one): lowest when higher is better."""
    return _tail_mean(values, fraction, highest=not higher_is_better)


def best_fraction_mean(values: Sequence[float], fraction: float = 0.1, higher_is_better: bool = True) -> float:
    return _tail_mean(values, fraction, highest=higher_is_better)


@dataclass(frozen=True)
class Distribution:
    """A metric's distribution over clients; ``variance`` is the population variance (ddof 0).

    ``of``: the clients the ``n`` stand for: ``n`` when every client was scored; more when
    they are a sample (``eval.clients: N``), and then ``mean_low``/``mean_high`` is the
    95% interval of the mean over all ``of`` (a t-interval with the finite-population
    correction); for a complete population it is the mean itself.
    """

    n: int
    mean: float
    median: float
    best10: float
    worst10: float
    variance: float
    of: int = 0
    mean_low: float = math.nan
    mean_high: float = math.nan


STATS = ("mean", "median", "best10", "worst10", "variance")


def _mean_interval(t: torch.Tensor, mean: float, of: int) -> tuple[float, float]:
    """95% interval of the mean over ``of`` clients from the sample ``t`` (drawn without replacement)."""
    n = len(t)
    if of <= n:
        return mean, mean
    if n < 2:
        return math.nan, math.nan
    from scipy.stats import t as student

    half = float(student.ppf(0.975, n - 1)) * float(t.std(unbiased=True)) / math.sqrt(n) * math.sqrt((of - n) / of)
    return mean - half, mean + half


def distribution(values: Sequence[float], higher_is_better: bool, of: int | None = None) -> Distribution:
    """The distribution of ``values`` (NaNs left out); ``of``: how many clients they are a sample of."""
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        nan = float("nan")
        return Distribution(0, nan, nan, nan, nan, nan, of or 0)
    t = torch.tensor(clean, dtype=torch.float64)
    ordered = sorted(clean)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    mean = float(t.mean())
    total = max(of or 0, len(clean))
    return Distribution(
        len(clean),
        mean,
        median,
        best_fraction_mean(clean, 0.1, higher_is_better),
        worst_fraction_mean(clean, 0.1, higher_is_better),
        float(t.var(unbiased=False)),
        total,
        *_mean_interval(t, mean, total),
    )


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
        return distribution(values, self.task.better(metric), of)

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
            d = distribution(values, better, of)
            out[f"{relation}_on_own_clients/{metric}_mean"] = d.mean
            out[f"{relation}_on_own_clients/{metric}_worst10"] = d.worst10
            if d.of > d.n:  # a sample of the clients: the interval of the mean over all of them
                out[f"{relation}_on_own_clients/{metric}_mean_low"] = d.mean_low
                out[f"{relation}_on_own_clients/{metric}_mean_high"] = d.mean_high
        for relation, values in gains.items():
            out[f"gain_vs_local/{relation}/{metric}_mean"] = sum(values) / len(values)
            out[f"gain_vs_local/{relation}/{metric}_share_better"] = sum(g > 0 for g in values) / len(values)
        return out


@dataclass(frozen=True)
class DistRow:
    model: str
    level: int
    population: str  # 'subtree' (the model's own clients) or 'all'
    metric: str
    dist: Distribution


@dataclass(frozen=True)
class ClientRow:
    client: str
    group: str
    relation: str
    model: str
    metric: str
    value: float
    gain_vs_local: float  # NaN where no local-only baseline ran


def distribution_csv(rows: Sequence[DistRow]) -> str:
    """One row per (model, population, metric); ``of`` and the mean's interval say what a sample stands for."""
    return table_csv(
        ["model", "level", "population", "metric", "n", *STATS, "of", "mean_low", "mean_high"],
        (
            [
                r.model,
                r.level,
                r.population,
                r.metric,
                r.dist.n,
                *(f"{getattr(r.dist, s):.6f}" for s in STATS),
                r.dist.of,
                f"{r.dist.mean_low:.6f}",
                f"{r.dist.mean_high:.6f}",
            ]
            for r in rows
        ),
    )


def clients_csv(rows: Sequence[ClientRow]) -> str:
    return table_csv(
        ["client", "group", "relation", "model", "metric", "value", "gain_vs_local"],
        ([r.client, r.group, r.relation, r.model, r.metric, f"{r.value:.6f}", f"{r.gain_vs_local:.6f}"] for r in rows),
    )
