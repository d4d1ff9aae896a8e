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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

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


class EvalSets:
    """The test sets of a tree, and how to build each one's statistics from client blocks.

    Built once per evaluation: subtree and union blocks are sums of their clients'
    blocks, one matrix product with the membership matrix ``[union sets, clients]``.
    """

    def __init__(self, tree: Tree) -> None:
        self.names = all_test_sets(tree)
        self.clients = client_order(tree)
        index = {c: i for i, c in enumerate(self.clients)}
        unions = [n for n in self.names if n.startswith(SUBTREE) or n == UNION]
        self.members = torch.zeros(len(unions), len(self.clients), dtype=torch.float64)
        for row, name in enumerate(unions):
            under = self.clients if name == UNION else tree.leaves_under(name[len(SUBTREE) :])
            self.members[row, [index[c] for c in under]] = 1.0

    def stack(self, blocks: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Per-client (+ proxy) statistics -> one float64 block per test set, in ``names`` order."""
        client_blocks = torch.stack([blocks[c] for c in self.clients]).to(torch.float64)
        flat = client_blocks.reshape(len(self.clients), -1)
        sums = (self.members @ flat).reshape(len(self.members), *client_blocks.shape[1:])
        return torch.cat([client_blocks, sums, blocks[PROXY].to(torch.float64)[None]])


@dataclass(frozen=True)
class EvalRow:
    node: str
    level: int
    test_set: str
    metric: str
    value: float


Stats = Mapping[ModelRef, Mapping[str, torch.Tensor]]  # model -> client id / proxy -> statistics

_KIND_RANK: dict[ModelKind, int] = {"node": 0, "personal": 1, "adapted": 2, "local_only": 3}


def model_order(tree: Tree, models: Iterable[ModelRef]) -> list[ModelRef]:
    """Node models in tree order, then personal models, adapted baselines, local-only ones (each in tree order)."""
    position = {n: i for i, n in enumerate(dfs_order(tree))}
    return sorted(models, key=lambda m: (_KIND_RANK[m.kind], position[m.node]))


def eval_rows(tree: Tree, stats: Stats, task: TaskMetrics) -> list[EvalRow]:
    """Long-format rows of every model on every test set (models in tree order, baselines last)."""
    rows: list[EvalRow] = []
    sets = EvalSets(tree)
    for model in model_order(tree, stats):
        level = tree[model.node].depth
        values = task.batch(sets.stack(stats[model]))
        columns = [values[metric].tolist() for metric in task.names]
        for i, test_set in enumerate(sets.names):
            for metric, column in zip(task.names, columns):
                rows.append(EvalRow(model.name, level, test_set, metric, column[i]))
    return rows


def matrix_csv(rows: Sequence[EvalRow]) -> str:
    return table_csv(
        ["node", "level", "test_set", "metric", "value"],
        ([r.node, r.level, r.test_set, r.metric, f"{r.value:.6f}"] for r in rows),
    )


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
    """A metric's distribution over clients; ``variance`` is the population variance (ddof 0)."""

    n: int
    mean: float
    median: float
    best10: float
    worst10: float
    variance: float


STATS = ("mean", "median", "best10", "worst10", "variance")


def distribution(values: Sequence[float], higher_is_better: bool) -> Distribution:
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        nan = float("nan")
        return Distribution(0, nan, nan, nan, nan, nan)
    t = torch.tensor(clean, dtype=torch.float64)
    ordered = sorted(clean)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return Distribution(
        len(clean),
        float(t.mean()),
        median,
        best_fraction_mean(clean, 0.1, higher_is_better),
        worst_fraction_mean(clean, 0.1, higher_is_better),
        float(t.var(unbiased=False)),
    )


class Evaluation:
    """Rows plus the tree and the task's metrics: lookups and per-client views of the matrix.

    ``refs`` are the models the rows are of; everywhere else a model is its ``name``
    (the rows' ``node`` column), and ``models`` lists those names in row order.
    """

    def __init__(self, tree: Tree, task: TaskMetrics, rows: Sequence[EvalRow], refs: Iterable[ModelRef]) -> None:
        self.tree, self.task, self.rows = tree, task, list(rows)
        self._value = {(r.node, r.test_set, r.metric): r.value for r in self.rows}
        self.refs = {ref.name: ref for ref in refs}
        self.models = list(dict.fromkeys(r.node for r in self.rows))
        assert set(self.models) <= set(self.refs), "rows of a model with no ModelRef"
        self.clients = client_order(tree)

    @classmethod
    def from_stats(cls, tree: Tree, task: TaskMetrics, stats: Stats) -> Evaluation:
        return cls(tree, task, eval_rows(tree, stats, task), stats)

    def value(self, model: str, test_set: str, metric: str | None = None) -> float | None:
        return self._value.get((model, test_set, metric or self.task.primary))

    def node_models(self) -> list[str]:
        return [m for m in self.models if self.refs[m].kind == "node"]

    def population(self, model: str) -> list[str]:
        """The clients of a model's subtree (a client's models: the client itself)."""
        return self.tree.leaves_under(self.refs[model].node)

    def per_client(self, model: str, clients: Iterable[str], metric: str | None = None) -> list[float]:
        out = [self.value(model, c, metric) for c in clients]
        return [v for v in out if v is not None]

    def distribution_rows(self) -> list[DistRow]:
        rows: list[DistRow] = []
        for model in self.models:
            level = self.tree[self.refs[model].node].depth
            for population, clients in (("subtree", self.population(model)), ("all", self.clients)):
                for metric in self.task.names:
                    d = distribution(self.per_client(model, clients, metric), self.task.better(metric))
                    rows.append(DistRow(model, level, population, metric, d))
        return rows

    def node_metrics(self, model: str) -> dict[str, float]:
        """What a node's MLflow run gets per evaluation: every test set, and its client distributions."""
        out = {f"eval/{t}/{m}": v for (node, t, m), v in self._value.items() if node == model}
        for population, clients in (("subtree", self.population(model)), ("all", self.clients)):
            for metric in self.task.names:
                d = distribution(self.per_client(model, clients, metric), self.task.better(metric))
                out.update({f"dist/{population}/{metric}_{s}": getattr(d, s) for s in STATS})
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
        return [(rel, m) for rel, m in chain if (m, client, self.task.primary) in self._value]

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
            d = distribution(values, better)
            out[f"{relation}_on_own_clients/{metric}_mean"] = d.mean
            out[f"{relation}_on_own_clients/{metric}_worst10"] = d.worst10
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
    return table_csv(
        ["model", "level", "population", "metric", "n", *STATS],
        (
            [r.model, r.level, r.population, r.metric, r.dist.n, *(f"{getattr(r.dist, s):.6f}" for s in STATS)]
            for r in rows
        ),
    )


def clients_csv(rows: Sequence[ClientRow]) -> str:
    return table_csv(
        ["client", "group", "relation", "model", "metric", "value", "gain_vs_local"],
        ([r.client, r.group, r.relation, r.model, r.metric, f"{r.value:.6f}", f"{r.gain_vs_local:.6f}"] for r in rows),
    )
